"""Layer-wise streamed prefill (LeanSparse §4): a prefix's per-layer state lives in pinned host memory and
passes through two reusable device buffers, the next layer's copy overlapping this layer's compute.

:class:`PrefixStreamer` holds, for each layer of a request, its rows of prefix state (exact index keys,
or any fixed-width rows) in pinned host memory, and two device buffers of ``capacity`` rows. For one
prefill chunk, in layer order:

* :meth:`begin_chunk` issues the first layer's load on the copy stream before any layer runs;
* :meth:`acquire` (layer l) makes the compute stream wait for l's load, then issues layer l+1's load
  into the other buffer; that copy waits for the event recorded when that buffer's previous layer was
  released, so a buffer is never overwritten while a kernel still reads it;
* :meth:`extend` writes the chunk's new rows behind the prefix in the buffer (what the layer then
  reads: prefix + chunk) and copies them back to host on the copy stream (the write-back is ordered
  before the next load into that buffer on the same stream); a caller that writes them in place
  (:meth:`buffer`) calls :meth:`commit` instead;
* :meth:`release` records that the compute stream is done with the layer's buffer.

With ``prefetch`` (the default), acquiring the last layer also issues the first layer's load for the
next chunk into the other buffer, so that load overlaps the last layer's compute instead of opening
the next chunk with nothing to hide it (its rows include this chunk's, written back before it on the
same copy stream). ``trace``, a list, collects timing events of every load for a timeline.

The device holds two layers' prefix state at any time, whatever the layer count. On a CPU device the
same calls run synchronously (the streams and events are not there), which is what the equivalence
tests run. ``waits`` records, per acquire on CUDA, the events it waited for, so a benchmark can time
the exposed load wait.
"""

from __future__ import annotations

import torch

from dsaindex.errors import DsaIndexError


class PrefixStreamer:
    """Per-layer prefix rows in pinned host memory, streamed through two device buffers.

    Parameters
    ----------
    layers : layer ids in the order a forward visits them; row_shape, dtype : one row of state (e.g.
    ``(132,)`` uint8 for an FP8 index key with its scale, or ``(128,)`` bfloat16); capacity : rows a
    request may hold (prefix + chunk); device : where the layers compute; pin : pin the host rows
    (default: when ``device`` is CUDA)
    """

    def __init__(self, layers: list[int], row_shape: tuple[int, ...], dtype: torch.dtype, capacity: int,
                 device: str | torch.device, pin: bool | None = None, prefetch: bool = True):
        self.layers = list(layers)
        self.next_of = dict(zip(self.layers, self.layers[1:], strict=False))
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        pin = cuda if pin is None else pin
        self.capacity = capacity
        self.host = {layer: torch.empty((capacity, *row_shape), dtype=dtype, pin_memory=pin) for layer in self.layers}
        self.length = dict.fromkeys(self.layers, 0)
        self.buffers = [torch.empty((capacity, *row_shape), dtype=dtype, device=self.device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device=self.device) if cuda else None
        self._loaded: list[torch.cuda.Event | None] = [None, None]
        self._released: list[torch.cuda.Event | None] = [None, None]
        self._slot: dict[int, int] = {}
        self._next_slot = 0
        self._skip: frozenset[int] = frozenset()
        self.prefetch = prefetch
        self._pending: int | None = None  # buffer holding the first layer's rows loaded for the next chunk
        self.trace: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] | None = None  # (layer, start, end) per load

    # ---- one chunk ---------------------------------------------------------------------------------
    def begin_chunk(self, skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Issue the first layer's load (call before the model's first layer runs). Layers in ``skip``
        will not read their prefix this chunk: no copy is made for them (their new rows are still
        written back by :meth:`extend`)."""
        self._slot.clear()
        self._skip = frozenset(skip)
        if self._pending is not None:  # issued during the previous chunk's last layer
            self._slot[self.layers[0]] = self._pending
            self._next_slot = self._pending ^ 1
            self._pending = None
            return
        self._next_slot = 0
        self._load(self.layers[0])

    def acquire(self, layer: int) -> torch.Tensor:
        """The layer's prefix rows on the device, [length, *row_shape] (a view of a buffer; not loaded
        for a skipped layer); issues the next layer's load into the other buffer."""
        if layer not in self._slot:
            raise DsaIndexError(f"Layer {layer}'s prefix was never loaded in this chunk.",
                                "call begin_chunk() before the first layer and acquire layers in order.")
        slot = self._slot[layer]
        if self._loaded[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[slot])
        nxt = self.next_of.get(layer)
        if nxt is not None:
            self._load(nxt)
        elif self.prefetch:  # the last layer: the next chunk's first load overlaps its compute
            first = self.layers[0]
            self._pending = self._load(first, next_chunk=True)
        return self.buffers[slot][: self.length[layer]]

    def extend(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Append the chunk's ``rows`` [n, *row_shape] (on the device) to the layer: written behind the
        prefix in its buffer and back to host; returns prefix + chunk rows on the device."""
        start = self.length[layer]
        self._check_room(layer, start + rows.shape[0])
        self.buffers[self._slot[layer]][start : start + rows.shape[0]] = rows
        return self.commit(layer, start + rows.shape[0])

    def buffer(self, layer: int) -> torch.Tensor:
        """The whole device buffer holding the acquired ``layer`` ([capacity, *row_shape]; its first
        ``length[layer]`` rows are the prefix): for a caller that writes the chunk's rows in place and
        then calls :meth:`commit`."""
        if layer not in self._slot:
            raise DsaIndexError(f"Layer {layer}'s prefix was never loaded in this chunk.",
                                "call begin_chunk() before the first layer and acquire layers in order.")
        return self.buffers[self._slot[layer]]

    def commit(self, layer: int, end: int) -> torch.Tensor:
        """Rows ``[length, end)`` of the layer's buffer were written in place (:meth:`buffer`): copy them
        back to host and make them part of the prefix; returns prefix + chunk rows on the device."""
        slot, start = self._slot[layer], self.length[layer]
        self._check_room(layer, end)
        buf = self.buffers[slot]
        if self.copy_stream is None:
            self.host[layer][start:end] = buf[start:end].cpu()
        else:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(written)
                self.host[layer][start:end].copy_(buf[start:end], non_blocking=True)
        self.length[layer] = end
        return buf[:end]

    def _check_room(self, layer: int, end: int) -> None:
        if end > self.capacity:
            raise DsaIndexError(f"Layer {layer} would hold {end} rows; the streamer was sized for {self.capacity}.",
                                "size the streamer for the longest request (prefix + chunk).")

    def release(self, layer: int) -> None:
        """The compute stream has issued every read of the layer's buffer."""
        if self.copy_stream is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._released[self._slot[layer]] = done

    def finish(self) -> None:
        """Wait for every write-back (the host rows are then complete)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    # ---- internals ---------------------------------------------------------------------------------
    def _load(self, layer: int, next_chunk: bool = False) -> int:
        """Issue ``layer``'s load into the next buffer; its slot. ``next_chunk``: a prefetch for the next
        chunk (every row, whatever this chunk skips; the slot is claimed by :meth:`begin_chunk`)."""
        slot = self._next_slot
        self._next_slot ^= 1
        if not next_chunk:
            self._slot[layer] = slot
        n = self.length[layer] if next_chunk or layer not in self._skip else 0
        if self.copy_stream is None:
            self.buffers[slot][:n] = self.host[layer][:n].to(self.device)
            return slot
        with torch.cuda.stream(self.copy_stream):
            if self._released[slot] is not None:  # the buffer's previous layer is done reading it
                self.copy_stream.wait_event(self._released[slot])
            start = None
            if self.trace is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.copy_stream)
            self.buffers[slot][:n].copy_(self.host[layer][:n], non_blocking=True)
            loaded = torch.cuda.Event(enable_timing=self.trace is not None)
            loaded.record(self.copy_stream)
            if start is not None:
                self.trace.append((layer, start, loaded))
        self._loaded[slot] = loaded
        return slot

    def reads(self, layer: int) -> bool:
        """Whether ``layer`` reads its prefix in this chunk (it was not skipped)."""
        return layer not in self._skip

    def reset(self) -> None:
        """Forget every layer's rows (a new request), and any load prefetched for the old one."""
        self.length = dict.fromkeys(self.layers, 0)
        self._pending = None

    def device_bytes(self) -> int:
        """Device bytes of prefix state: the two buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers)
