"""Run a command (uv) with the user's pip configuration as uv's settings.

uv does not read pip's configuration files or ``PIP_*`` variables; a machine that points pip at a local
wheel folder, a mirror or a constraints file would otherwise install from elsewhere under uv. This maps
what ``pip config list`` reports (files and environment) onto uv's variables, then runs the command:

    python tools/with_pip_config.py uv pip install --python .venv/bin/python -e .

find-links -> UV_FIND_LINKS, index-url -> UV_DEFAULT_INDEX, extra-index-url -> UV_EXTRA_INDEX_URL,
constraint -> UV_CONSTRAINT, cert -> SSL_CERT_FILE; and UV_INDEX_STRATEGY=unsafe-best-match (pip's rule:
the best version across every index). Variables already set are kept.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

# pip key -> (uv variable, separator uv expects between several values)
MAPPING = {
    "find-links": ("UV_FIND_LINKS", ","),
    "index-url": ("UV_DEFAULT_INDEX", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", " "),
}
LINE = re.compile(r"^[^.]*\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def pip_settings() -> dict[str, list[str]]:
    """pip's configured values by key (later sources win, as pip reads them: files, then environment)."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m and m.group("key") in MAPPING:
            found[m.group("key")] = m.group("value").split()
    return found


def uv_environment(settings: dict[str, list[str]], base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    for key, values in settings.items():
        name, sep = MAPPING[key]
        if values and name not in env:
            env[name] = sep.join(values)
    env.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")
    if "SSL_CERT_FILE" in env:
        env.setdefault("UV_NATIVE_TLS", "1")
    return env


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python tools/with_pip_config.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    env = uv_environment(pip_settings(), dict(os.environ))
    return subprocess.run(sys.argv[1:], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
