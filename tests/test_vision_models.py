"""A model's vision projector around the engine: found beside the model, given (--mmproj,
config.toml) or pulled with it (the catalog's gemma3-4b-it, a Hub repo's mmproj file), counted
by the planner, reported by `doctor` and `edgechat models`. The projector is the tiny one
tests/tiny_mmproj.py writes (random weights) beside the embedded SmolLM2; downloads come from
the local stand-in Hub of test_hub.py. Nothing here reads what a picture shows."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner
from test_hub import FakeHub, add_to_hub_cache, edgechat, one_line_error
from tiny_mmproj import text_embedding_width, write_tiny_mmproj

from edgechat.cli import cli
from edgechat.cli.common import mmproj_for
from edgechat.engine import Engine, EngineConfig
from edgechat.errors import ModelFormatError, ModelNotFoundError, ModelTooLargeError, UsageError
from edgechat.models import catalog, find_projector, hub, planner, read_model_info, resolve_model
from edgechat.models.ggufinfo import read_projector_info
from edgechat.models.settings import with_model_settings

VISION = "gemma3-4b-it"
ENTRY = catalog.load_catalog()[VISION]
#: a revision of the catalog's repo older than test_hub's COMMIT: a projector pulled before the model changed
OLDER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def mmproj(smollm2_path, tmp_path_factory):
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj-tiny-f16.gguf", text_embedding_width(smollm2_path))


@pytest.fixture
def folder(tmp_path, smollm2_path):
    """A folder holding a model (a link to SmolLM2) and nothing else."""
    where = tmp_path / "models"
    where.mkdir()
    (where / "smol.gguf").symlink_to(smollm2_path)
    return where


def write_header_only(path, **fields) -> None:
    """A projector GGUF of metadata alone: what read_projector_info reads (never loaded)."""
    writer = gguf.GGUFWriter(str(path), "clip")
    for key, value in fields.items():
        (writer.add_bool if isinstance(value, bool) else writer.add_string)(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- finding it -----------------------------------------------------------------------------------


def test_a_projector_is_found_beside_the_model_or_given_and_a_wrong_one_is_one_line(folder, mmproj, smollm2_path):
    model = folder / "smol.gguf"
    assert find_projector(None, model) is None
    (folder / "mmproj-smol-bf16.gguf").symlink_to(mmproj)
    assert find_projector(None, model) == folder / "mmproj-smol-bf16.gguf"  # the only one
    (folder / "mmproj-smol-f16.gguf").symlink_to(mmproj)
    assert find_projector(None, model) == folder / "mmproj-smol-f16.gguf"  # several: the f16 one
    assert hub.pick_projector(["mmproj-a-bf16.gguf", "mmproj-a-f32.gguf", "a-Q4_K_M.gguf"]) is None
    # given, it wins over the ones beside
    assert find_projector(str(mmproj), model) == mmproj
    for given, error, needle in ((folder / "missing.gguf", ModelNotFoundError, "projector file not found"),
                                 (smollm2_path, ModelFormatError, "is not a projector (mmproj) GGUF")):
        with pytest.raises(error) as exc:
            find_projector(str(given), model)
        assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_the_projector_header_says_what_it_reads(mmproj, tmp_path):
    info = read_projector_info(mmproj)
    assert (info.vision, info.audio, info.projector_type, info.modalities) == (True, False, "mlp", ("vision",))
    assert info.size_bytes == mmproj.stat().st_size
    both = tmp_path / "mmproj-omni.gguf"
    write_header_only(both, **{"clip.has_vision_encoder": True, "clip.has_audio_encoder": True,
                               "clip.vision.projector_type": "gemma3", "clip.audio.projector_type": "ultravox"})
    assert read_projector_info(both).modalities == ("vision", "audio")
    assert read_projector_info(both).projector_type == "gemma3+ultravox"
    ears = tmp_path / "mmproj-ears.gguf"
    write_header_only(ears, **{"clip.has_audio_encoder": True, "clip.projector_type": "ultravox"})
    assert read_projector_info(ears).modalities == ("audio",)


@pytest.mark.parametrize("projector_first", [True, False])
def test_a_catalog_pull_is_found_in_the_cache_where_it_landed(isolated_dirs, smollm2_path, mmproj, projector_first):
    """The repo changed between the model's download and its projector's: each sits in its own
    revision's folder (the later one is refs/main), and both are found offline all the same."""
    first, second = ((ENTRY.mmproj.file, mmproj), (ENTRY.default.file, smollm2_path))[:: 1 if projector_first else -1]
    add_to_hub_cache(isolated_dirs, ENTRY.repo, *first, commit=OLDER)
    add_to_hub_cache(isolated_dirs, ENTRY.repo, *second)
    model = resolve_model(VISION, isolated_dirs)
    assert model.name == ENTRY.default.file and model.resolve() == smollm2_path.resolve()
    assert not (model.parent / ENTRY.mmproj.file).exists()
    found = find_projector(None, model, VISION, isolated_dirs)
    assert found is not None and found.parent != model.parent and found.resolve() == mmproj.resolve()
    assert find_projector(None, model) is None  # without the reference: nothing beside it
    # a Hub reference to the same repo finds both too
    ref = f"{ENTRY.repo}:Q4_K_M"
    assert resolve_model(ref, isolated_dirs) == model and find_projector(None, model, ref, isolated_dirs) == found


# --- the planner -----------------------------------------------------------------------------------


def test_the_planner_counts_the_projector(folder, mmproj, smollm2_path, isolated_dirs):
    info = read_model_info(smollm2_path)
    size = planner.projector_bytes(mmproj)
    assert size == mmproj.stat().st_size and planner.projector_bytes(None) == 0
    text = planner.plan_for(info, 1024, available=64 << 30)
    seeing = planner.plan_for(info, 1024, available=64 << 30, projector=size)
    assert seeing.projector == size and seeing.total == text.total + size
    # memory for 1024 tokens of text, not for those and the projector: the context halves
    room = int((text.total + size // 2) / planner.headroom()) + 1
    assert planner.choose_context(info, available=room).n_ctx == 1024
    assert planner.choose_context(info, available=room, projector=size).n_ctx == 512
    assert planner.max_context_that_fits(info, available=room) >= 1024 > planner.max_context_that_fits(info, available=room, projector=size)
    with pytest.raises(ModelTooLargeError, match=r"KV cache \d+ MiB, vision projector \d+ MiB\) but only"):
        planner.choose_context(info, 1024, available=room, projector=size)
    # the engine finds the one beside its model, and its plan counts it
    (folder / "mmproj-smol-f16.gguf").symlink_to(mmproj)
    with Engine(EngineConfig(model=str(folder / "smol.gguf"), paths=isolated_dirs, n_ctx=512)) as engine:
        assert engine.modalities == ("vision",)
        assert engine.plan.projector == size == engine.projector.memory_bytes


# --- doctor and models ---------------------------------------------------------------------------


def test_doctor_and_models_say_vision(isolated_dirs, smollm2_path, mmproj, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # every column whole
    lines = lambda *args: CliRunner().invoke(cli, list(args)).output.splitlines()  # noqa: E731
    # not downloaded: the catalog's entry says it reads images
    listed = next(line for line in lines("models") if line.startswith(f"{VISION} "))
    assert "gemma3, vision" in listed and "not downloaded" in listed
    assert "vision projector 812 MiB" in next(line for line in lines("models", "--catalog") if line.startswith(f"{VISION} "))
    add_to_hub_cache(isolated_dirs, ENTRY.repo, ENTRY.default.file, smollm2_path)
    add_to_hub_cache(isolated_dirs, ENTRY.repo, ENTRY.mmproj.file, mmproj)
    for command in ("models", "doctor"):
        row = next(line for line in lines(command) if line.startswith(f"{VISION} "))
        assert "llama, vision" in row, (command, row)
        text_only = next(line for line in lines(command) if line.startswith("smollm2-135m-instruct "))
        assert "vision" not in text_only


def test_models_rm_takes_the_projector_with_the_last_model_of_its_repo(isolated_dirs, smollm2_path, mmproj, tmp_path):
    """`rm` removes a link and the file it resolves to: every blob here is a copy, never the
    embedded model or the module's projector."""
    def cache(repo: str, name: str, source) -> Path:
        copy = tmp_path / "blobs" / f"{repo.replace('/', '--')}--{name}"
        copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(source, copy)
        return add_to_hub_cache(isolated_dirs, repo, name, copy)

    rm = lambda name: CliRunner().invoke(cli, ["models", "rm", name, "--yes", "--url", "http://127.0.0.1:9"])  # noqa: E731
    model = cache(ENTRY.repo, ENTRY.default.file, smollm2_path)
    projector = cache(ENTRY.repo, ENTRY.mmproj.file, mmproj)
    assert rm(VISION).exit_code == 0
    assert not model.is_symlink() and not projector.is_symlink()
    # two quants of a Hub repo: the first to go leaves the projector to the other
    repo = "edgetest/vision-GGUF"
    cache(repo, "smol-Q4_1.gguf", smollm2_path)
    cache(repo, "smol-Q8_0.gguf", smollm2_path)
    projector = cache(repo, "mmproj-smol-f16.gguf", mmproj)
    assert rm(f"{repo}:Q4_1").exit_code == 0 and projector.is_symlink()
    assert rm(f"{repo}:Q8_0").exit_code == 0 and not projector.is_symlink()
    assert smollm2_path.is_file() and mmproj.is_file()


# --- pull --------------------------------------------------------------------------------------------


@pytest.fixture
def online(tmp_path, monkeypatch):
    """Starts a stand-in Hub serving `files` (and describing some as others, `listed`) and points
    the Hub client at it; closed at the test's end."""
    import huggingface_hub.constants

    servers = []

    def start(files, listed=None) -> FakeHub:
        server = FakeHub(files, listed)
        servers.append(server)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        return server

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    yield start
    for server in servers:
        server.close()


def pull(*args):
    return CliRunner().invoke(cli, ["pull", "--yes", *args], standalone_mode=False)


def fetched(server) -> list[str]:
    return [path.rsplit("/", 1)[-1] for method, path in server.requests if method == "GET" and "/resolve/" in path]


def test_pull_fetches_the_catalog_projector_with_the_model(online, isolated_dirs, smollm2_path, mmproj):
    server = online({(ENTRY.repo, ENTRY.default.file): smollm2_path, (ENTRY.repo, ENTRY.mmproj.file): mmproj})
    result = pull(VISION)
    assert result.exception is None, result.exception
    assert "+ vision projector 812 MiB" in result.stderr  # announced with the model, from the catalog
    assert "projector: " in result.stdout and "mlp; reads vision" in result.stdout
    assert sorted(fetched(server)) == sorted([ENTRY.default.file, ENTRY.mmproj.file])
    model = resolve_model(VISION, isolated_dirs)
    found = find_projector(None, model, VISION, isolated_dirs)
    assert found == model.parent / ENTRY.mmproj.file and found.read_bytes() == mmproj.read_bytes()
    # here now: a second pull asks the Hub nothing
    seen = len(server.requests)
    assert pull(VISION).exception is None and len(server.requests) == seen


def test_pull_no_mmproj_skips_it_and_a_later_pull_fetches_it_alone(online, isolated_dirs, smollm2_path, mmproj):
    server = online({(ENTRY.repo, ENTRY.default.file): smollm2_path, (ENTRY.repo, ENTRY.mmproj.file): mmproj})
    result = pull("--no-mmproj", VISION)
    assert result.exception is None, result.exception
    assert "projector" not in result.output and fetched(server) == [ENTRY.default.file]
    assert hub.cached_projector(VISION, isolated_dirs) is None
    result = pull(VISION)
    assert result.exception is None and fetched(server) == [ENTRY.default.file, ENTRY.mmproj.file]
    assert hub.cached_projector(VISION, isolated_dirs) is not None


def test_a_corrupted_or_wrong_projector_is_refused_and_not_kept(online, isolated_dirs, smollm2_path, mmproj, tmp_path):
    tampered = tmp_path / "tampered.gguf"
    data = bytearray(mmproj.read_bytes())
    data[-100] ^= 0xFF  # in the weights: still a GGUF of the same size
    tampered.write_bytes(bytes(data))
    model = (ENTRY.repo, ENTRY.default.file)
    online({model: smollm2_path, (ENTRY.repo, ENTRY.mmproj.file): tampered}, listed={(ENTRY.repo, ENTRY.mmproj.file): mmproj})
    result = pull(VISION)
    assert isinstance(result.exception, ModelFormatError)
    message = str(result.exception)
    assert f"{ENTRY.mmproj.file}'s sha256 is" in message and "it was not kept" in message and "\n" not in message
    assert hub.cached_projector(VISION, isolated_dirs) is None
    # a text model's GGUF in the projector's place: a GGUF, but not a projector
    online({model: smollm2_path, (ENTRY.repo, ENTRY.mmproj.file): smollm2_path})
    result = pull(VISION)
    assert isinstance(result.exception, ModelFormatError)
    assert str(result.exception) == f"{VISION}: the Hub's {ENTRY.mmproj.file} is not a projector (mmproj) GGUF; it was not kept"
    assert hub.cached_projector(VISION, isolated_dirs) is None
    assert not list(hub.hub_cache(isolated_dirs).rglob(ENTRY.mmproj.file))


def test_a_hub_repo_pulled_by_name_brings_its_f16_projector(online, isolated_dirs, smollm2_path, mmproj):
    repo = "edgetest/vision-GGUF"
    server = online({(repo, "smol-Q4_1.gguf"): smollm2_path, (repo, "mmproj-smol-f16.gguf"): mmproj,
                     (repo, "mmproj-smol-bf16.gguf"): mmproj})
    result = pull(f"{repo}:Q4_1")
    assert result.exception is None, result.exception
    assert sorted(fetched(server)) == ["mmproj-smol-f16.gguf", "smol-Q4_1.gguf"]
    model = resolve_model(f"{repo}:Q4_1", isolated_dirs)
    assert find_projector(None, model, f"{repo}:Q4_1", isolated_dirs) == model.parent / "mmproj-smol-f16.gguf"
    # a repo without one pulls the model alone
    plain = "edgetest/text-GGUF"
    server = online({(plain, "smol-Q4_1.gguf"): smollm2_path})
    result = pull(f"{plain}:Q4_1")
    assert result.exception is None and "projector" not in result.output and fetched(server) == ["smol-Q4_1.gguf"]


def test_a_hub_repos_projector_counts_in_the_fit_question_before_the_download(online, isolated_dirs, smollm2_path,
                                                                               mmproj, monkeypatch):
    repo = "edgetest/vision-GGUF"
    server = online({(repo, "smol-Q4_1.gguf"): smollm2_path, (repo, "mmproj-smol-f16.gguf"): mmproj})
    asked: list[int] = []
    monkeypatch.setattr(planner, "weights_fit", lambda size, available=None: asked.append(size) or False)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)  # no terminal to ask on: refused
    result = CliRunner().invoke(cli, ["pull", f"{repo}:Q4_1"], standalone_mode=False)
    both = smollm2_path.stat().st_size + mmproj.stat().st_size
    assert isinstance(result.exception, UsageError) and asked == [both], (result.exception, asked)
    assert f"({catalog.format_size(both)}) will not fit" in str(result.exception)
    assert fetched(server) == []  # nothing downloaded before the question
    # text only: the model's own size
    result = CliRunner().invoke(cli, ["pull", "--no-mmproj", f"{repo}:Q4_1"], standalone_mode=False)
    assert isinstance(result.exception, UsageError) and asked[-1] == smollm2_path.stat().st_size


def test_pull_offline_of_a_model_here_without_its_projector_says_what_to_do(isolated_dirs, smollm2_path):
    add_to_hub_cache(isolated_dirs, ENTRY.repo, ENTRY.default.file, smollm2_path)
    line = one_line_error(edgechat("pull", "--yes", VISION))
    assert "vision projector" in line and "HF_HUB_OFFLINE" in line and "--no-mmproj" in line
    proc = edgechat("pull", "--no-mmproj", VISION)
    assert proc.returncode == 0 and "ready: " in proc.stdout, proc.stderr


# --- --mmproj and config.toml ----------------------------------------------------------------------


def test_mmproj_values_go_to_their_models():
    refs = ["smollm2-135m-instruct", "/models/other.gguf"]
    assert mmproj_for({None: "a.gguf"}, refs) == {"smollm2-135m-instruct": "a.gguf"}
    assert mmproj_for({"other": "b.gguf", None: "a.gguf"}, refs) == {"/models/other.gguf": "b.gguf", "smollm2-135m-instruct": "a.gguf"}
    assert mmproj_for({None: "a.gguf"}, [None]) == {None: "a.gguf"}  # run's default model
    with pytest.raises(UsageError, match=r"nosuch is not a model given here \(smollm2-135m-instruct, /models/other.gguf\)"):
        mmproj_for({"nosuch": "a.gguf"}, refs)
    with pytest.raises(UsageError, match="given two projectors"):
        mmproj_for({None: "a.gguf", "smollm2-135m-instruct": "b.gguf"}, refs)


def test_serve_mmproj_reaches_the_right_model(folder, mmproj, monkeypatch, caplog):
    """Both forms, parsed by serve and carried into each model's EngineConfig; the first model
    loads with it (the listening is left out)."""
    from edgechat.engine.pool import ModelPool
    from edgechat.server import listen

    configs = {}
    add = ModelPool.add

    def recording(self, name, config, idle_unload=None):
        configs[config.model] = config.mmproj
        return add(self, name, config, idle_unload)

    monkeypatch.setattr(ModelPool, "add", recording)
    monkeypatch.setattr(listen, "serve", lambda app, sockets: None)
    other = str(folder / "smol.gguf")
    base = ["serve", "--port", "0", "--ctx", "512", "--parallel", "1"]
    with caplog.at_level(logging.INFO, logger="edgechat.server"):
        result = CliRunner().invoke(cli, [*base, "-m", "smollm2-135m-instruct", "-m", other, "--mmproj", str(mmproj)],
                                    standalone_mode=False)
    assert result.exception is None, result.exception
    assert configs == {"smollm2-135m-instruct": str(mmproj), other: None}
    assert "serving smollm2-135m-instruct (reads vision)" in caplog.text
    configs.clear()
    result = CliRunner().invoke(cli, [*base, "-m", "smollm2-135m-instruct", "-m", other, "--mmproj", f"smol={mmproj}"],
                                standalone_mode=False)
    assert result.exception is None, result.exception
    assert configs == {"smollm2-135m-instruct": None, other: str(mmproj)}


def test_serve_mmproj_errors_are_one_line(folder, smollm2_path, mmproj):
    for args, needle in (([str(folder / "missing.gguf")], "projector file not found"),
                         ([f"smollm2-135m-instruct={smollm2_path}"], "is not a projector (mmproj) GGUF"),
                         ([f"nosuch={mmproj}"], "nosuch is not a model given here"),
                         ([str(mmproj), str(mmproj)], "give one FILE")):
        line = one_line_error(edgechat("serve", "--port", "0", *[a for value in args for a in ("--mmproj", value)]))
        assert "--mmproj" in line and needle in line, line


def test_a_models_mmproj_in_config_toml(isolated_dirs, mmproj):
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text(f'[models."smollm2-135m-instruct"]\nmmproj = "{mmproj}"\n')
    config = with_model_settings(EngineConfig(model="smollm2-135m-instruct", paths=isolated_dirs))
    assert config.mmproj == str(mmproj)
    # --mmproj wins over it
    assert with_model_settings(EngineConfig(model="smollm2-135m-instruct", paths=isolated_dirs, mmproj="x.gguf")).mmproj == "x.gguf"
    isolated_dirs.config_file.write_text('[models."smollm2-135m-instruct"]\nmmproj = "nowhere.gguf"\n')
    with pytest.raises(UsageError) as exc:
        with_model_settings(EngineConfig(model="smollm2-135m-instruct", paths=isolated_dirs))
    message = str(exc.value)
    assert str(isolated_dirs.config_file) in message and "projector file not found: nowhere.gguf" in message and "\n" not in message
