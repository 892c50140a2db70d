"""Docker's config and real credential helper programs, for the credentials snap reads."""

from __future__ import annotations

import base64
import json
import os
import sys


def docker_config(tmp_path, auths: dict, **more) -> str:
    """A Docker config dir holding `auths` (host -> {"auth": base64 user:password}) and `more` keys
    (credHelpers, credsStore); for DOCKER_CONFIG."""
    cfg_dir = tmp_path / "docker-config"
    cfg_dir.mkdir(exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps({"auths": auths, **more}))
    return str(cfg_dir)


def basic(user: str, password: str) -> dict:
    return {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}


def credential_helper(tmp_path, name: str, secrets: dict) -> tuple[str, str]:
    """A real `docker-credential-NAME` program (as docker-credential-pass or -ecr-login are) that
    keeps credentials in a JSON file, seeded with `secrets` (server -> (user, password)), speaks the
    helper protocol (get, store, erase) and logs each call as "ACTION SERVER". Returns (PATH with it
    first, the log file); the store is the log's name with .json."""
    bin_dir = tmp_path / "helper-bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"{name}.log"
    store = tmp_path / f"{name}.log.json"
    store.write_text(json.dumps({k: {"Username": u, "Secret": p} for k, (u, p) in secrets.items()}))
    prog = bin_dir / f"docker-credential-{name}"
    prog.write_text(f"""#!{sys.executable}
import json, sys
action, data = sys.argv[1], sys.stdin.read()
table = json.load(open({str(store)!r}))
server = json.loads(data)["ServerURL"] if action == "store" else data.strip()
open({str(log)!r}, "a").write(action + " " + server + "\\n")
if action == "store":
    table[server] = {{k: v for k, v in json.loads(data).items() if k != "ServerURL"}}
elif action == "get" and server in table:
    print(json.dumps(dict(table[server], ServerURL=server)))
elif action == "erase" and server in table:
    del table[server]
else:
    print("credentials not found in native keychain")
    sys.exit(1)
json.dump(table, open({str(store)!r}, "w"))
""")
    prog.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}", str(log)
