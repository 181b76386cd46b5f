"""Fresh synthetic documents for long captures: the corpus's four tasks (needles, key-value lookups,
variable chains, long copies) from a seed the checkpoint never saw, in the held-out natural text.

The corpus's own held-out synthetic split is 0.79 MB (about 233K BPE tokens): enough for 64K captures,
not for several 128K sequences. This writes as many bytes as asked, as one JSONL file for
``dsaindex capture -c FILE``.

    python docs/results/synthetic_heldout_docs.py CORPUS OUT.jsonl [MB] [SEED]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsaindex.pipelines.reference_corpus import synthetic_documents

FILLER_SOURCES = ("austen", "sotu", "dictionary", "bible")


def main(corpus: str, out: str, megabytes: float = 2.0, seed: int = 101) -> None:
    heldout = [json.loads(line) for line in (Path(corpus) / "heldout.jsonl").open()]
    natural = [d["text"] for d in heldout if d["source"] in FILLER_SOURCES]
    if not natural:
        raise SystemExit(f"{corpus}/heldout.jsonl has no held-out {', '.join(FILLER_SOURCES)} text to fill with")
    docs = synthetic_documents(int(megabytes * 1e6), natural, seed, heldout=True)
    with open(out, "w") as f:
        for d in docs:
            f.write(json.dumps({"source": d.source, "title": d.title, "text": d.text}) + "\n")
    print(f"{len(docs)} documents, {sum(len(d.text) for d in docs) / 1e6:.2f} MB, seed {seed}, "
          f"filler from {len(natural)} held-out documents -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(float(a) for a in sys.argv[3:4]), *(int(a) for a in sys.argv[4:5]))
