"""Catalog names and Hub references, offline: a real Hugging Face cache layout on disk whose
files are the embedded SmolLM2 GGUF, resolved with HF_HUB_OFFLINE=1 and loaded by the engine."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgechat.cli import cli
from edgechat.errors import ModelNotFoundError, UsageError
from edgechat.models import catalog, hub, known_model_names, read_model_info, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEST_REPO = "edgetest/tiny-GGUF"
TEST_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
# the real catalog entry whose cached copy the tests fake, so the shipped catalog itself is exercised
CATALOG_NAME = "smollm2-360m-instruct"


def add_to_hub_cache(paths, repo: str, filename: str, target: Path, commit: str = COMMIT) -> Path:
    """Lay out repo/filename as huggingface_hub stores a download: blob, snapshot link, refs/main
    (pointing at `commit`, the revision downloaded last)."""
    root = hub.hub_cache(paths) / f"models--{repo.replace('/', '--')}"
    blob = root / "blobs" / hashlib.sha256(str(target).encode()).hexdigest()  # one blob per file
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        blob.symlink_to(target)
    snap = root / "snapshots" / commit / filename
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hub_cache(isolated_dirs, smollm2_path):
    """edgetest/tiny-GGUF and the catalog's SmolLM2 360M repo, both 'downloaded' as SmolLM2 135M."""
    entry = catalog.load_catalog()[CATALOG_NAME]
    return {
        "test": add_to_hub_cache(isolated_dirs, TEST_REPO, TEST_FILE, smollm2_path),
        "catalog": add_to_hub_cache(isolated_dirs, entry.repo, entry.default.file, smollm2_path),
    }


def edgechat(*args, timeout: int = 300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "edgechat", *args], check=False, capture_output=True, text=True, timeout=timeout, env=env)


def one_line_error(proc) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgechat: error: "), proc.stderr
    return lines[0]


# --- the catalog -------------------------------------------------------------------------------


def test_shipped_catalog_is_complete_and_consistent():
    raw = tomllib.loads(resources.files("edgechat.models").joinpath("catalog.toml").read_text())
    names = [m["name"] for m in raw["model"]]
    assert len(names) == len(set(names)) >= 8
    entries = catalog.load_catalog()
    assert list(entries) == names
    for e in entries.values():
        assert e.repo.count("/") == 1 and e.licence and e.architecture and e.description and e.context >= 2048
        assert e.default.quant == "Q4_K_M", e.name
        for quant, f in e.files.items():
            assert catalog.QUANT_RE.match(quant) and f.file.endswith(".gguf") and f.size > 50_000_000
            # uploaders put the quant in the file name; a mismatch is a copy-paste slip
            assert quant.lower() in f.file.lower(), (e.name, quant, f.file)
    # the repository root's models/catalog.toml is the same file the package ships
    root_copy = Path(__file__).resolve().parents[1] / "models" / "catalog.toml"
    assert tomllib.loads(root_copy.read_text()) == raw


# sizes read from the Hub's listings (issue 14): exact bytes, so a slip in the catalog shows here
LISTED_SIZES = {
    ("qwen3-0.6b", "Q4_K_M"): 396_705_472,
    ("qwen3-0.6b", "Q8_0"): 639_447_744,
    ("qwen3-4b", "Q4_K_M"): 2_497_280_256,
    ("phi4-mini-instruct", "Q4_K_M"): 2_491_874_272,
}


def test_catalog_sizes_are_the_listed_ones_and_drive_the_fit_column(isolated_dirs, monkeypatch):
    from edgechat.models import planner
    from edgechat.tui.screens.models import catalog_models

    entries = catalog.load_catalog()
    for (name, quant), size in LISTED_SIZES.items():
        assert entries[name].files[quant].size == size, (name, quant)
    assert entries["phi4-mini-instruct"].files["Q8_0"].file == "Phi-4-mini-instruct.Q8_0.gguf"
    # 1.5 GiB free: the 0.6B fits, the 4B models do not; both listings say so from the catalog's size,
    # in the same words and units (nothing is downloaded in this data dir)
    monkeypatch.setattr(planner, "available_memory", lambda: 3 << 29)
    picker = {row.ref: row for row in catalog_models(isolated_dirs)}
    listing = {line.split()[0]: line for line in CliRunner().invoke(cli, ["models"]).output.splitlines() if line.strip()}
    for name, entry in entries.items():
        row = catalog.catalog_row(entry)
        # a vision model's verdict counts the projector pulled with it
        assert row.fits == planner.weights_fit(entry.default.size + (entry.mmproj.size if entry.mmproj else 0))
        assert picker[name].fits == row.fits and picker[name].detail.startswith(f"{row.size} · {row.quant}")
        assert row.size in listing[name] and row.fit_text in listing[name]
    assert picker["qwen3-0.6b"].fits and not picker["qwen3-4b"].fits and not picker["gemma3-4b-it"].fits
    assert "~378 MiB" in listing["qwen3-0.6b"] and "~2.3 GiB" in listing["qwen3-4b"]


def test_catalog_validation_names_every_problem():
    bad = {
        "schema": 1,
        "model": [
            {"name": "a", "repo": "o/r", "architecture": "llama", "licence": "mit", "context": 4096,
             "description": "x", "files": {"Q4_K_M": {"file": "a-Q4_K_M.gguf", "size": 10}}},
            {"name": "a", "repo": "o/r", "architecture": "llama", "licence": "mit", "context": 4096,
             "description": "x", "files": {"Q4KM": {"file": "a.safetensors", "size": 10}}},
            {"name": "b", "repo": "not-a-repo", "architecture": "llama", "context": 4096, "description": "x", "files": {}},
        ],
    }
    with pytest.raises(ValueError) as exc:
        catalog.parse_catalog(bad)
    msg = str(exc.value)
    for needle in ("duplicate name", "'Q4KM' is not a GGUF quant", "not a .gguf", "licence missing", "repo must be OWNER/NAME", "no files"):
        assert needle in msg, needle
    with pytest.raises(ValueError, match="schema"):
        catalog.parse_catalog({"schema": 2, "model": bad["model"][:1]})


def test_catalog_lookup_by_name_and_quant():
    entry, f = catalog.lookup("Qwen2.5-0.5B-Instruct")
    assert f is entry.default and f.quant == "Q4_K_M"
    assert catalog.lookup("qwen2.5-0.5b-instruct:q8_0")[1].quant == "Q8_0"
    assert catalog.lookup("no-such-model") is None
    with pytest.raises(ModelNotFoundError, match=r"has no Q3_K_S file.*Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q3_K_S"):
        catalog.lookup("qwen2.5-0.5b-instruct:q3_k_s")


# --- references --------------------------------------------------------------------------------


def test_reference_forms_parse():
    assert hub.parse_hub_ref(f"hf:{TEST_REPO}/{TEST_FILE}") == hub.HubRef(TEST_REPO, TEST_FILE, None, f"hf:{TEST_REPO}/{TEST_FILE}")
    assert hub.parse_hub_ref(f"{TEST_REPO}:q4_1").quant == "Q4_1"
    assert hub.parse_hub_ref(f"hf:{TEST_REPO}").quant == "Q4_K_M"
    assert hub.parse_hub_ref("hf:o/r/sub/dir/m.gguf").file == "sub/dir/m.gguf"
    # plain names and paths are not Hub references
    for ref in ("smollm2", "models/x.gguf", "o/r", "./o/r:Q4_0", "o/r:notaquant"):
        assert hub.parse_hub_ref(ref) is None, ref


@pytest.mark.parametrize(
    "ref, needle",
    [
        ("hf:onlyowner", "malformed Hub reference"),
        ("hf:o/r/model.safetensors", "GGUF files only"),
        ("hf:o/r/../../etc/passwd.gguf", "malformed Hub reference"),
        ("hf:o/r:Q9_Z", "not a GGUF quant name"),
    ],
)
def test_malformed_references_are_clear_errors(ref, needle, isolated_dirs):
    with pytest.raises(ModelNotFoundError, match=needle):
        resolve_model(ref, isolated_dirs)


def test_quant_picking_from_a_listing():
    files = ["README.md", "m-Q4_0.gguf", "m-Q4_0_4_4.gguf", "m-Q4_K_M.gguf", "mmproj-m-Q4_K_M.gguf", "m-UD-Q4_K_XL.gguf"]
    pick = lambda q, fs=files: hub._pick(hub.HubRef("o/r", None, q, f"o/r:{q}"), fs)
    assert pick("Q4_0") == "m-Q4_0.gguf"  # not Q4_0_4_4
    assert pick("Q4_K_M") == "m-Q4_K_M.gguf"  # not the vision projector
    with pytest.raises(ModelNotFoundError, match=r"has no Q8_0 GGUF file; it has Q4_0, Q4_K_M, Q4_K_XL"):
        pick("Q8_0")
    with pytest.raises(ModelNotFoundError, match="several Q4_K_M files"):
        pick("Q4_K_M", files + ["m-abliterated-Q4_K_M.gguf"])
    # a model split in parts is picked by its first part, which llama.cpp is given
    split = ["Q8_0/m-Q8_0-00002-of-00002.gguf", "Q8_0/m-Q8_0-00001-of-00002.gguf"]
    assert pick("Q8_0", split) == "Q8_0/m-Q8_0-00001-of-00002.gguf"
    with pytest.raises(ModelNotFoundError, match="several Q8_0 files"):
        pick("Q8_0", split + ["m-Q8_0.gguf"])


# --- offline resolution from the cache ---------------------------------------------------------


def test_hub_references_resolve_offline_from_the_cache(hub_cache, isolated_dirs):
    expected = hub_cache["test"]
    for ref in (f"hf:{TEST_REPO}/{TEST_FILE}", f"{TEST_REPO}:Q4_1", f"hf:{TEST_REPO}:q4_1"):
        path = resolve_model(ref, isolated_dirs)
        assert path == expected, ref
    info = read_model_info(path)
    assert info.architecture == "llama" and info.quant == "Q4_1" and info.name.lower().startswith("smollm2")


def test_catalog_name_resolves_offline_and_is_listed(hub_cache, isolated_dirs, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # wide enough for every column (pytest-xdist's workers say 80)
    assert resolve_model(CATALOG_NAME, isolated_dirs) == hub_cache["catalog"]
    assert resolve_model(CATALOG_NAME.upper(), isolated_dirs) == hub_cache["catalog"]
    names = known_model_names(isolated_dirs)
    assert CATALOG_NAME in names and "qwen3-0.6b" not in names
    out = CliRunner().invoke(cli, ["models"]).output
    downloaded = next(line for line in out.splitlines() if line.startswith(CATALOG_NAME))
    assert "Q4_1" in downloaded and "not downloaded" not in downloaded
    qwen = next(line for line in out.splitlines() if line.startswith("qwen3-0.6b "))
    assert "not downloaded" in qwen and "MiB" in qwen
    listing = CliRunner().invoke(cli, ["models", "--catalog"]).output
    assert "unsloth/Qwen3-0.6B-GGUF" in listing
    assert "Q4_K_M" in next(line for line in listing.splitlines() if line.startswith(CATALOG_NAME))


def test_missing_files_offline_say_how_to_get_them(hub_cache, isolated_dirs):
    for ref in (f"{CATALOG_NAME}:Q8_0", f"{TEST_REPO}:Q8_0", "hf:nobody/nothing-GGUF/x.gguf", "qwen3-0.6b"):
        with pytest.raises(ModelNotFoundError) as exc:
            resolve_model(ref, isolated_dirs)
        msg = str(exc.value)
        assert "\n" not in msg and "HF_HUB_OFFLINE" in msg and f"edgechat pull {ref}" in msg, msg


def test_names_close_to_catalog_entries_are_suggested(isolated_dirs):
    with pytest.raises(ModelNotFoundError, match="did you mean qwen3-0.6b"):
        resolve_model("qwen3-0.5b", isolated_dirs)
    with pytest.raises(ModelNotFoundError, match=r"add a quant: Qwen/Qwen3-GGUF:Q4_K_M"):
        resolve_model("Qwen/Qwen3-GGUF", isolated_dirs)


# --- the commands, as a user runs them ---------------------------------------------------------


@pytest.mark.slow
def test_run_loads_a_hub_model_offline(hub_cache):
    proc = edgechat("run", "-m", f"hf:{TEST_REPO}/{TEST_FILE}", "--temperature", "0", "--max-tokens", "4", "--ctx", "256", "Hi")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_cli_errors_are_one_line(hub_cache):
    line = one_line_error(edgechat("run", "-m", "hf:nobody/nothing-GGUF/x.gguf", "--max-tokens", "1", "Hi"))
    assert "edgechat pull hf:nobody/nothing-GGUF/x.gguf" in line
    line = one_line_error(edgechat("pull", "hf:o/r/model.bin"))
    assert "GGUF files only" in line
    line = one_line_error(edgechat("pull", "qwen3-0.6b"))
    assert "HF_HUB_OFFLINE" in line
    proc = edgechat("pull", f"{TEST_REPO}:Q4_1")
    assert proc.returncode == 0, proc.stderr
    assert f"ready: {hub_cache['test']}" in proc.stdout and "llama, Q4_1" in proc.stdout


# --- online, against a local server that answers like the Hub ----------------------------------


class FakeHub:
    """Serves the Hub's file listing and resolve endpoints for a few repos, from local files.
    The listing gives each .gguf file's size and sha256 as the Hub does for LFS files; `listed`
    makes it describe a file as another one (what a tampered or truncated download looks like)."""

    def __init__(self, files: dict[tuple[str, str], Path], listed: dict[tuple[str, str], Path] | None = None):
        import http.server
        import json
        import threading

        from edgechat.models.embedded import sha256_file

        self.files, self.requests = files, []
        hub = self

        def entry(key, path):
            described = (listed or {}).get(key, path)
            size = described.stat().st_size
            item = {"type": "file", "path": key[1], "size": size, "oid": "0" * 40}
            if key[1].endswith(".gguf"):
                item["lfs"] = {"oid": sha256_file(described), "size": size, "pointerSize": 134}
            return item

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _file(self):
                # /OWNER/REPO/resolve/main/FILE
                parts = self.path.split("?")[0].strip("/").split("/", 4)
                if len(parts) == 5 and parts[2:4] == ["resolve", "main"]:
                    key = (f"{parts[0]}/{parts[1]}", parts[4])
                    if key in hub.files:
                        return hub.files[key]
                    self._missing(f"{parts[0]}/{parts[1]}")
                else:
                    self.send_error(400)
                return None

            def _missing(self, repo):
                known = any(r == repo for r, _ in hub.files)
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound" if known else "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _headers(self, path: Path, status=200, length=None):
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                # the cache names blobs by ETag: distinct files need distinct tags
                self.send_header("ETag", f'"{hashlib.sha256(str(path).encode()).hexdigest()}"')
                self.send_header("Content-Length", str(length if length is not None else path.stat().st_size))
                self.end_headers()

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path))
                if path := self._file():
                    self._headers(path)

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                if self.path.startswith("/api/models/"):
                    repo = "/".join(self.path.split("?")[0].split("/")[3:5])
                    listing = [entry((r, f), p) for (r, f), p in hub.files.items() if r == repo]
                    if not listing:
                        return self._missing(repo)
                    body = json.dumps(listing).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if path := self._file():
                    start = 0
                    if rng := self.headers.get("Range"):
                        start = int(rng.split("=")[1].split("-")[0])
                    size = path.stat().st_size
                    self._headers(path, 206 if start else 200, size - start)
                    with open(path, "rb") as fh:
                        fh.seek(start)
                        while block := fh.read(1 << 20):
                            self.wfile.write(block)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(smollm2_path, tmp_path):
    entry = catalog.load_catalog()[CATALOG_NAME]
    not_gguf = tmp_path / "not-a-model.gguf"
    not_gguf.write_bytes(b"<html>not a model</html>" * 100)
    server = FakeHub({
        (TEST_REPO, TEST_FILE): smollm2_path,
        (TEST_REPO, "README.md"): not_gguf,
        (TEST_REPO, "broken-Q8_0.gguf"): not_gguf,
        (entry.repo, entry.default.file): smollm2_path,
    })
    yield server
    server.close()


def online(fake_hub, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    return dict(env, HF_ENDPOINT=fake_hub.url, HF_HOME=str(tmp_path / "hf-home"))


@pytest.mark.slow
def test_pull_downloads_once_then_runs_offline(fake_hub, isolated_dirs, tmp_path):
    env = online(fake_hub, tmp_path)
    pull = lambda ref: subprocess.run([sys.executable, "-m", "edgechat", "pull", ref],  # noqa: E731
                                      capture_output=True, text=True, timeout=300, env=env, check=False)
    proc = pull(f"{TEST_REPO}:Q4_1")  # picked from the repo listing
    assert proc.returncode == 0, proc.stderr
    assert "ready: " in proc.stdout and "llama, Q4_1" in proc.stdout
    assert any(r[1].startswith(f"/api/models/{TEST_REPO}/tree/main") for r in fake_hub.requests)
    proc = pull(CATALOG_NAME)
    assert proc.returncode == 0, proc.stderr
    assert "about 258 MiB" in proc.stderr  # the catalog's size, announced before the download
    # a second pull of a cached model asks the network nothing
    seen = len(fake_hub.requests)
    assert pull(CATALOG_NAME).returncode == 0 and len(fake_hub.requests) == seen
    # the wrong things fail in one line
    for ref, needle in ((f"{TEST_REPO}:Q8_0", "broken-Q8_0.gguf is not a GGUF file; it was not kept"),
                        (f"{TEST_REPO}:Q5_K_M", "has no Q5_K_M GGUF file; it has Q4_1, Q8_0"),
                        ("nobody/nothing-GGUF:Q4_K_M", "no Hub repository nobody/nothing-GGUF"),
                        (f"hf:{TEST_REPO}/missing.gguf", f"{TEST_REPO} has no file missing.gguf")):
        proc = pull(ref)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode != 0 and lines[-1].startswith("edgechat: error: ") and needle in lines[-1], proc.stderr
        assert "Traceback" not in proc.stderr
    assert not list(hub.hub_cache(isolated_dirs).rglob("broken-Q8_0.gguf"))
    fake_hub.close()
    # offline after: both resolve from edgechat's cache with the server gone
    for ref in (f"{TEST_REPO}:Q4_1", f"hf:{TEST_REPO}/{TEST_FILE}", CATALOG_NAME):
        path = resolve_model(ref, isolated_dirs)
        assert path.is_relative_to(hub.hub_cache(isolated_dirs)) and read_model_info(path).quant == "Q4_1"


def test_model_picker_describes_downloaded_catalog_models(hub_cache, isolated_dirs):
    from edgechat.tui.screens.models import catalog_models

    rows = {row.ref: row for row in catalog_models(isolated_dirs)}
    # the 'downloaded' 360M entry is read from its cached file; the others say how to get them
    assert rows[CATALOG_NAME].fits is True and "Q4_1" in rows[CATALOG_NAME].detail
    assert "not downloaded" not in rows[CATALOG_NAME].detail
    assert "not downloaded (edgechat pull qwen3-0.6b)" in rows["qwen3-0.6b"].detail


@pytest.mark.slow
def test_a_split_model_is_pulled_whole_and_runs_offline(smollm2_split, isolated_dirs, tmp_path):
    """Every part is downloaded; from the cache, the reference resolves to the first part."""
    repo = "edgetest/split-GGUF"
    names = [f"Q4_1/SmolLM2-Q4_1-{i:05d}-of-00002.gguf" for i in (1, 2)]
    server = FakeHub({(repo, name): part for name, part in zip(names, smollm2_split, strict=True)})
    try:
        env = online(server, tmp_path)
        proc = subprocess.run([sys.executable, "-m", "edgechat", "pull", f"{repo}:Q4_1"],
                              capture_output=True, text=True, timeout=300, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
    finally:
        server.close()
    path = resolve_model(f"{repo}:Q4_1", isolated_dirs)
    assert path.as_posix().endswith(names[0])
    assert read_model_info(path).size_bytes == sum(p.stat().st_size for p in smollm2_split)
    proc = edgechat("run", "-m", f"{repo}:Q4_1", "--temperature", "0", "--max-tokens", "4", "Hi")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_pull_refuses_a_tampered_or_truncated_download(smollm2_path, isolated_dirs, tmp_path):
    """The Hub lists each file's size and sha256: a download that differs is not kept."""
    tampered = tmp_path / "tampered.gguf"
    data = bytearray(smollm2_path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte inside the tensors: still a GGUF, same size
    tampered.write_bytes(bytes(data))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    repo = "edgetest/tampered-GGUF"
    server = FakeHub({(repo, "ok-Q4_1.gguf"): smollm2_path, (repo, "bad-Q4_0.gguf"): tampered,
                      (repo, "short-Q8_0.gguf"): truncated},
                     listed={(repo, "bad-Q4_0.gguf"): smollm2_path, (repo, "short-Q8_0.gguf"): smollm2_path})
    try:
        env = online(server, tmp_path)
        pull = lambda ref: subprocess.run([sys.executable, "-m", "edgechat", "pull", ref],  # noqa: E731
                                          capture_output=True, text=True, timeout=300, env=env, check=False)
        for ref, needle in ((f"{repo}:Q4_0", "bad-Q4_0.gguf's sha256 is "),
                            (f"{repo}:Q8_0", f"short-Q8_0.gguf arrived with {len(data) // 2:,} bytes, the Hub lists {len(data):,}")):
            proc = pull(ref)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode != 0 and needle in lines[-1] and "it was not kept" in lines[-1], proc.stderr
            assert "Traceback" not in proc.stderr
        assert pull(f"{repo}:Q4_1").returncode == 0  # the listed bytes, verified
    finally:
        server.close()
    cached = {p.name for p in hub.hub_cache(isolated_dirs).rglob("*.gguf")}
    assert cached == {"ok-Q4_1.gguf"}
    blobs = [p for p in hub.hub_cache(isolated_dirs).rglob("blobs/*") if p.is_file()]
    assert len(blobs) == 1  # the refused downloads left no blob behind


def test_pull_asks_before_a_model_that_will_not_fit(fake_hub, isolated_dirs, tmp_path, monkeypatch):
    """The question comes before any byte is fetched (the stand-in Hub is reachable, so the
    question is what stops the pull; an unreachable one is a one-line error before it)."""
    from edgechat.models import planner

    for key, value in online(fake_hub, tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(planner, "available_memory", lambda: 256 << 20)
    result = CliRunner().invoke(cli, ["pull", "qwen3-4b"], standalone_mode=False)
    assert isinstance(result.exception, UsageError)
    assert str(result.exception) == ("qwen3-4b (2.3 GiB) will not fit in the memory free here (218 MiB); "
                                     "pass --yes to download it anyway")
    # --yes skips the question: the download is attempted (and fails here: the stand-in has no such file)
    result = CliRunner().invoke(cli, ["pull", "--yes", "qwen3-4b"], standalone_mode=False)
    assert isinstance(result.exception, ModelNotFoundError) and "will not fit" not in str(result.exception)


def test_pull_asks_before_any_hub_file_that_will_not_fit(fake_hub, isolated_dirs, tmp_path, monkeypatch):
    """Not only catalog entries: a Hub file's size comes from the listing, before the download."""
    from edgechat.models import planner

    for key, value in online(fake_hub, tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    monkeypatch.setattr(planner, "available_memory", lambda: 64 << 20)
    result = CliRunner().invoke(cli, ["pull", f"{TEST_REPO}:Q4_1"], standalone_mode=False)
    assert isinstance(result.exception, UsageError), result.output
    assert "will not fit in the memory free here" in str(result.exception) and "pass --yes" in str(result.exception)
    assert not any("/resolve/" in path for _, path in fake_hub.requests)  # nothing downloaded
    result = CliRunner().invoke(cli, ["pull", "--yes", f"{TEST_REPO}:Q4_1"], standalone_mode=False)
    assert result.exception is None, result.output
    assert "ready: " in result.output


def test_pull_of_a_model_already_here_needs_no_hub(fake_hub, isolated_dirs, tmp_path, monkeypatch):
    """Asking whether a download fits must not turn a cached model's pull into a Hub call."""
    import huggingface_hub.constants

    for key, value in online(fake_hub, tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    assert CliRunner().invoke(cli, ["pull", f"{TEST_REPO}:Q4_1"], standalone_mode=False).exception is None
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the Hub is gone; the file is here
    result = CliRunner().invoke(cli, ["pull", f"{TEST_REPO}:Q4_1"], standalone_mode=False)
    assert result.exception is None, result.exception
    assert "ready: " in result.output
