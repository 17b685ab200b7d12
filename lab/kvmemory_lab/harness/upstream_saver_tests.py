"""Run LangGraph's own saver tests with every saver wrapped in ``KVCheckpointSaver``.

LangGraph's test files are not part of this project: they are read from a source you name and
put in a temporary folder, then run by pytest with :mod:`.upstream_saver_plugin`, which changes
only the saver factories (each saver the tests build comes back wrapped) and the PostgreSQL
server URL. Sources, any of:

- a langgraph checkout (``libs/checkpoint/tests``, ``libs/checkpoint-sqlite/tests``,
  ``libs/checkpoint-postgres/tests``);
- a bare clone or mirror with ``--ref`` (e.g. ``--ref checkpointsqlite==3.1.2``), read with
  ``git archive``;
- a folder of the packages' source distributions (``.tar.gz`` or unpacked), which carry their
  ``tests/``: ``pip download --no-deps --no-binary :all: langgraph-checkpoint==X
  langgraph-checkpoint-sqlite==Y langgraph-checkpoint-postgres==Z -d DIR`` with the installed
  versions (``--download DIR`` does that).

Suites: ``memory`` (InMemorySaver), ``sqlite`` (SqliteSaver, AsyncSqliteSaver), ``postgres``
(PostgresSaver, ShallowPostgresSaver and their async forms, on the server of ``--postgres``: a
role that may create databases, as the upstream tests create one per test; a scratch database
stands in for their fixed one and is dropped afterwards). Store, serializer and cache tests are
left out (``SKIPPED_FILES``): they build no saver. ``--baseline`` also runs each suite unwrapped,
so failures the wrapper adds stand out from ones the installed versions already have.

Writes ``upstream_saver_tests.json`` and ``.md`` (counts per suite, failing test ids) to ``--out``.
Usage: ``python -m kvmemory_lab.harness.upstream_saver_tests --download /tmp/lg-sdists --baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

SUITES = {  # suite -> (distribution, folder in a langgraph checkout)
    "memory": ("langgraph-checkpoint", "libs/checkpoint"),
    "sqlite": ("langgraph-checkpoint-sqlite", "libs/checkpoint-sqlite"),
    "postgres": ("langgraph-checkpoint-postgres", "libs/checkpoint-postgres"),
}
# files that build no LangGraph saver: stores, TTL sweepers, serializers (plain and encrypted), the Redis cache
SKIPPED_FILES = ("test_store.py", "test_async_store.py", "test_ttl.py", "test_jsonplus.py", "test_encrypted.py",
                 "test_redis_cache.py")
DEFAULT_POSTGRES = os.environ.get("KVMEMORY_POSTGRES_URL", "postgresql://kvmemory:kvmemory@localhost:5432/kvmemory")
PLUGIN = "kvmemory_lab.harness.upstream_saver_plugin"


def installed_versions() -> dict[str, str]:
    return {dist: version(dist) for dist, _ in SUITES.values()}


def download_sdists(folder: Path) -> Path:
    """``pip download`` the source distributions of the installed checkpoint packages."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{dist}=={v}" for dist, v in installed_versions().items()]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", *pins,
                    "-d", str(folder)], check=True)
    return folder


def tests_folder(source: Path, suite: str, ref: str | None, scratch: Path) -> Path:
    """The suite's upstream ``tests`` folder, copied (with the ``tests`` package name kept) into
    ``scratch/<suite>/tests``."""
    dist, libdir = SUITES[suite]
    target = scratch / suite
    target.mkdir(parents=True)
    if ref is not None:
        archive = subprocess.run(["git", "--git-dir", str(source), "archive", ref, f"{libdir}/tests"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target), "--strip-components", "2"], input=archive, check=True)
    elif (source / libdir / "tests").is_dir():
        shutil.copytree(source / libdir / "tests", target / "tests")
    else:
        _from_sdist(source, dist, target)
    for name in SKIPPED_FILES:
        (target / "tests" / name).unlink(missing_ok=True)
    return target


def _from_sdist(folder: Path, dist: str, target: Path) -> None:
    stem = f"{dist.replace('-', '_')}-{version(dist)}"
    unpacked, packed = folder / stem, folder / f"{stem}.tar.gz"
    if not unpacked.is_dir():
        if not packed.is_file():
            raise SystemExit(f"{folder} has neither a langgraph checkout's libs/ nor {packed.name}: pass a checkout, "
                             f"a git dir with --ref, or --download {folder}")
        with tarfile.open(packed) as tar:
            tar.extractall(folder, filter="data")
    shutil.copytree(unpacked / "tests", target / "tests")


def run_suite(folder: Path, wrapped: bool, env: dict, timeout_s: int) -> dict:
    """pytest on one suite; returns counts and the ids of failing tests."""
    report = folder / f"junit-{'wrapped' if wrapped else 'plain'}.xml"
    env = {**env, "KVM_UPSTREAM_WRAP": "1" if wrapped else "0"}
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", PLUGIN, "-p", "no:cacheprovider",
           "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
           "-W", "ignore::DeprecationWarning", f"--junitxml={report}", "--rootdir", str(folder)]
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)
    if not report.is_file():
        return {"error": done.stdout[-3000:] + done.stderr[-3000:]}
    return _counts(report)


def _counts(report: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failing, skips = [], []
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            node = case.find("failure") if case.find("failure") is not None else case.find("error")
            counts["failed" if node.tag == "failure" else "errors"] += 1
            failing.append({"test": name, "message": (node.get("message") or "")[:300]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skips.append({"test": name, "reason": (case.find("skipped").get("message") or "")[:200]})
        else:
            counts["passed"] += 1
    return {**counts, "failing": failing, "skips": skips}


def postgres_env(url: str) -> tuple[dict, str]:
    """Env for the upstream PostgreSQL conftest and a scratch database (its name is returned)."""
    import psycopg

    scratch = f"kvm_upstream_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {scratch}")
    root = url.rsplit("/", 1)[0] + "/"
    return {"KVM_UPSTREAM_PG_ROOT": root, "KVM_UPSTREAM_PG_URL": f"{root}{scratch}?sslmode=disable"}, scratch


def drop_database(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def to_markdown(results: dict) -> str:
    lines = ["| suite | run | passed | failed | errors | skipped |", "|---|---|---|---|---|---|"]
    for suite, runs in results["suites"].items():
        for run, r in runs.items():
            if "error" in r:
                lines.append(f"| {suite} | {run} | pytest did not run: see JSON | | | |")
            else:
                lines.append(f"| {suite} | {run} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} |")
    for suite, runs in results["suites"].items():
        for run, r in runs.items():
            for f in r.get("failing", []):
                lines.append(f"- {suite} ({run}) FAIL `{f['test']}`: {f['message'][:160]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", type=Path, help="langgraph checkout, bare clone (with --ref) or sdist folder")
    where.add_argument("--download", type=Path, help="pip download the installed versions' sdists here and use them")
    parser.add_argument("--ref", help="git ref (tag) to read from a bare clone given as --source")
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="default: all three")
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES,
                        help="PostgreSQL URL of a role that may create databases")
    parser.add_argument("--baseline", action="store_true", help="also run each suite with the savers unwrapped")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/upstream_saver_tests"),
                        help="folder for the JSON / markdown")
    parser.add_argument("--timeout-s", type=int, default=900, help="per pytest run")
    args = parser.parse_args(argv)
    source = download_sdists(args.download) if args.download else args.source
    suites = args.suite or list(SUITES)
    results = {"versions": installed_versions(), "source": str(source), "ref": args.ref, "suites": {}}
    with tempfile.TemporaryDirectory(prefix="kvm-upstream-") as scratch:
        base_env = {**os.environ, "KVM_UPSTREAM_BLOB_DIR": str(Path(scratch) / "blobs"),
                    # absolute: pytest runs in the temporary folder
                    "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path[1:] if p)}
        for suite in suites:
            folder = tests_folder(source, suite, args.ref, Path(scratch))
            env, database = dict(base_env), None
            if suite == "postgres":
                extra, database = postgres_env(args.postgres)
                env.update(extra)
            try:
                runs = {"wrapped": run_suite(folder, True, env, args.timeout_s)}
                if args.baseline:
                    runs["plain"] = run_suite(folder, False, env, args.timeout_s)
            finally:
                if database is not None:
                    drop_database(args.postgres, database)
            results["suites"][suite] = runs
            counts = {run: {k: v for k, v in r.items() if k not in ("failing", "skips")} for run, r in runs.items()}
            print(suite, counts, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "upstream_saver_tests.json").write_text(json.dumps(results, indent=1))
    (args.out / "upstream_saver_tests.md").write_text(to_markdown(results))
    return results


if __name__ == "__main__":
    main()
