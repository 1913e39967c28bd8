"""The lane schema: what each rank of a lane runs, and in which order the ranks start.

A lane is an image, its models and runtime inputs, the serve settings every rank shares
(``[lanes.X.serve]``), and what each rank runs:

- ``[lanes.X]`` ``env``, ``mounts`` and ``options``: for every rank;
- ``[lanes.X.roles.head]`` and ``[lanes.X.roles.worker]``: the command (``entrypoint`` and ``args``),
  more ``env`` and ``mounts``, and ``ready``: how that rank is known to be up;
- ``[lanes.X.ranks.N]``: the same keys for rank N alone, over its role's;
- ``start``: ``workers-first`` (each worker up, highest rank first, then the head: TensorFold's
  followers), ``workers-in-rank-order`` (each worker up, rank 1 first, then the head: vLLM's headless
  workers) or ``head-first`` (the head up, then the workers: an engine whose rank 0 listens first);
  the lane is ready when the head's ``health`` answers
  on the serve port; ``start_timeout`` bounds each rank's start.

Strings in ``entrypoint``, ``args`` and ``env`` may use the placeholders of `PLACEHOLDERS`; an env entry
that renders empty is left out (a host without RDMA devices gets no ``NCCL_IB_HCA``). Mount sources
are ``model:NAME`` (a lane model's folder), ``input:NAME`` (a runtime kit or file of ``[kits]``/``[files]``),
``derived:NAME`` (a derivation's per-rank output folder), ``state:NAME`` (a folder of the lane's own on
the host, for logs and caches) or an absolute host path. Where each lives on a host is
`builder.store.placement.mount_path`'s answer; what ``docker run`` a rank gets is `builder.launch`'s.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from builder.inputs.schema import Name, Strict
from builder.installer.manifest import is_name

#: what a lane's strings may name, substituted per rank by builder.launch
PLACEHOLDERS = (
    "host", "port", "served_name", "context", "streams", "tensor_parallel", "rank", "world_size",
    "master_addr", "rendezvous_port", "lane", "address", "rdma_devices", "interfaces", "interface", "gid_index",
    "speculative_tokens", "cudagraph_capture_sizes",
)
ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
MOUNT_KINDS = ("model", "input", "derived", "state")


class Serve(Strict):
    """The settings every rank of the lane shares (and the API the head serves)."""

    tensor_parallel: int = Field(ge=1, le=64)
    context: int = Field(ge=1)
    streams: int = Field(ge=1)
    port: int = Field(ge=1, le=65535)
    served_name: str = Field(min_length=1)
    rendezvous_port: int = Field(default=29760, ge=1, le=65535)
    host: str = "0.0.0.0"
    #: tokens a speculative draft proposes per step (vLLM's num_speculative_tokens, the recipes' k)
    speculative_tokens: int | None = Field(default=None, ge=1, le=64)

    def capture_sizes(self) -> list[int]:
        """The CUDA-graph capture sizes of a speculative lane (recipes.md §10.6): the sorted union of
        the multiples of k up to k·streams and of k+1 up to (k+1)·streams, k the draft length (a step
        verifies k or k+1 tokens per stream)."""
        k = self.speculative_tokens
        if k is None:
            return []
        return sorted({m * i for m in (k, k + 1) for i in range(1, self.streams + 1)})


class Mount(Strict):
    """One bind mount: ``source`` (see the module) at ``target`` in the container, read-only unless
    ``writable``."""

    source: str = Field(min_length=1)
    target: str = Field(min_length=2)
    writable: bool = False
    #: the target is a path of the image that this mount replaces (a patched file over the engine's
    #: own): the image must have it, or the mount silently adds a file instead (builder.image.mounttargets)
    replaces: bool = False

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v.startswith("/"):
            if ".." in v.split("/") or "," in v or ":" in v:
                raise ValueError(f"host path {v!r}: want an absolute path without '..', ',' or ':'")
            return v
        kind, _, name = v.partition(":")
        if kind not in MOUNT_KINDS or not is_name(name):
            raise ValueError(f"{v!r}: want model:NAME, input:NAME, derived:NAME, state:NAME or an absolute host path")
        return v

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        if not v.startswith("/") or ".." in v.split("/") or "," in v or ":" in v:
            raise ValueError(f"{v!r}: want an absolute path in the container without '..', ',' or ':'")
        return v

    @property
    def kind(self) -> str:
        return "host" if self.source.startswith("/") else self.source.partition(":")[0]

    @property
    def name(self) -> str:
        return self.source if self.source.startswith("/") else self.source.partition(":")[2]


class Device(Strict):
    path: str = Field(pattern=r"^/dev/[A-Za-z0-9_./-]+$")
    #: only on hosts whose inventory lists RDMA devices (``fabric.rdma_devices``)
    when: Literal["always", "rdma"] = "always"


class Options(Strict):
    """The container options builder knows; any other key is refused. None: leave docker's default.
    They apply on hosts that expect GPUs with the NVIDIA runtime; a host that expects none (the test
    fleet's) runs the rank without them (but with the RDMA devices its inventory lists)."""

    gpus: str | None = Field(default=None, pattern=r"^(all|\d+|device=[0-9,]+)$")
    ipc: Literal["host", "private", "shareable"] | None = None
    shm_size: str | None = Field(default=None, pattern=r"^\d+[bkmg]?$")
    #: the container's memory limit (``--memory``) and memory plus swap (``--memory-swap``)
    memory: str | None = Field(default=None, pattern=r"^\d+[bkmg]?$")
    memory_swap: str | None = Field(default=None, pattern=r"^(-1|\d+[bkmg]?)$")
    #: the kernel's OOM score adjustment for the container's processes (``--oom-score-adj``)
    oom_score_adj: int | None = Field(default=None, ge=-1000, le=1000)
    ulimits: dict[str, str] = {}
    cap_add: list[str] = []
    devices: list[Device] = []

    @field_validator("ulimits")
    @classmethod
    def _ulimits(cls, v: dict[str, str]) -> dict[str, str]:
        known = {"memlock", "stack", "nofile", "nproc", "core"}
        for k, val in v.items():
            if k not in known:
                raise ValueError(f"unknown ulimit {k!r} (known: {', '.join(sorted(known))})")
            if not re.fullmatch(r"-?\d+(:-?\d+)?", val):
                raise ValueError(f"ulimit {k}: {val!r} is not N or SOFT:HARD")
        return v

    @field_validator("cap_add")
    @classmethod
    def _caps(cls, v: list[str]) -> list[str]:
        for c in v:
            if not re.fullmatch(r"[A-Z_]+", c):
                raise ValueError(f"not a capability name: {c!r}")
        return v


class Ready(Strict):
    """How a rank is known to be up after its container starts: exactly one of
    ``health`` (an HTTP path answering 200 on the serve port), ``port`` (a TCP port it listens on, a
    number or a placeholder such as "{rendezvous_port}"), ``log`` (a regular expression its log
    matches) or ``running = true`` (its container is running after a short settle)."""

    health: str | None = Field(default=None, pattern=r"^/[A-Za-z0-9_./-]*$")
    port: int | str | None = None
    log: str | None = Field(default=None, min_length=1)
    running: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> Ready:
        given = [k for k in ("health", "port", "log", "running") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("want exactly one of health, port, log or running = true")
        if self.log is not None:
            try:
                re.compile(self.log)
            except re.error as e:
                raise ValueError(f"log: not a regular expression: {e}") from None
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("health", "port", "log", "running") if getattr(self, k) not in (None, False))


def check_env_names(v: dict[str, str]) -> dict[str, str]:
    for k in v:
        if not ENV_NAME_RE.fullmatch(k):
            raise ValueError(f"not an environment variable name: {k!r}")
    return v


#: a container's environment: names as a shell would take them
Env = Annotated[dict[str, str], AfterValidator(check_env_names)]


class Run(Strict):
    """What one role or rank runs: its command, env, mounts and readiness (each optional here; the
    rank's own entry wins over its role's, env and mounts add up)."""

    entrypoint: list[str] | None = None
    args: list[str] | None = None
    env: Env = {}
    mounts: list[Mount] = []
    ready: Ready | None = None


class Roles(Strict):
    """What the head and the workers run; by default the image's own command, the head ready once
    the lane's health answers, a worker once its container runs."""

    head: Run = Run(ready=Ready(health="/health"))
    worker: Run | None = Run(ready=Ready(running=True))


class Derivation(Strict):
    """A per-rank input made on each host by ``command`` in the lane's image over pinned inputs
    (``mounts``: ``model:`` or ``input:`` sources, read-only), writing into ``output`` (the folder the
    lane mounts with ``derived:NAME``). Its folder on the host is addressed by its inputs
    (builder.launch.derivplan): made once, and again only when an input, the image, the rank or the command
    changes."""

    command: list[str] = Field(min_length=1)
    output: str = Field(min_length=2)
    mounts: list[Mount] = []
    note: str | None = None

    @field_validator("output")
    @classmethod
    def _output(cls, v: str) -> str:
        return Mount._target(v)

    @field_validator("mounts")
    @classmethod
    def _inputs_only(cls, v: list[Mount]) -> list[Mount]:
        for i, m in enumerate(v):
            if m.kind not in ("model", "input") or m.writable:
                raise ValueError(f"mounts[{i}]: a derivation reads model:NAME or input:NAME sources, read-only")
        return v


#: the replay prompts a lane that names none is asked (chat turns at T=0): short, with one right answer
DEFAULT_REPLAY = ["17*19=", "Say OK.", "What is the capital of France?", "Name a colour.", "Count from one to twenty."]


class ChatProbe(Strict):
    """A chat turn at T=0 and what its reply must contain (the recipes' "17*19=" -> 323)."""

    prompt: str = Field(min_length=1)
    expect: str = Field(min_length=1)


class ToolGate(Strict):
    """A tool call asked plainly and streamed (the call must name ``name`` with ``arguments``, and no
    template markup may reach the content), then a second turn given ``result`` whose reply must
    contain ``expect`` (it uses the tool's result)."""

    prompt: str = Field(default="What is the weather in Paris?", min_length=1)
    name: str = Field(default="get_weather", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    description: str = "Current weather in a city"
    arguments: dict[str, str] = {"city": "Paris"}
    result: str = '{"city": "Paris", "weather": "sunny", "celsius": 21}'
    expect: str = Field(default="sunny", min_length=1)


class Speed(Strict):
    """A fixed decode check (the recipes' count-to-100): tok/s of one streamed reply, judged against
    ``floor`` (tok/s; none: not judged) and failed when it drops below the baseline release's figure
    by more than ``tolerance`` (a fraction; none: not compared, for a lane on shared test machines)."""

    prompt: str = Field(default="Count from 1 to 100, separated by spaces.", min_length=1)
    max_tokens: int = Field(default=256, ge=8, le=8192)
    floor: float | None = Field(default=None, gt=0)
    tolerance: float | None = Field(default=None, ge=0, lt=1)


class Gates(Strict):
    """What a release must answer before the lane counts as serving (builder.hostscripts.gates asks them
    of the head's API; checks/test_gates.py judges them). Every reply is also judged by the garble gate
    (one token repeated, or not valid text), and ``replay`` is answered at T=0 into the release's
    replay record, which a redeploy compares with the running release's."""

    #: more names /v1/models must list besides the served name
    aliases: list[str] = []
    chat_probe: ChatProbe | None = ChatProbe(prompt="17*19=", expect="323")
    #: the lane has a reasoning parser: a streamed reply with ``reasoning_request`` must bring both
    #: reasoning_content and content
    reasoning: bool = False
    tools: ToolGate | None = None
    #: the engine has a per-request draft switch (TensorFold's ``"draft": false``): the ids must be equal
    draft_switch: bool = False
    #: this many requests at once must all complete (0: no burst gate)
    burst: int = Field(default=4, ge=0, le=64)
    #: this many copies of one prompt at once must equal the prompt alone, id for id (0: none)
    concurrent: int = Field(default=8, ge=0, le=64)
    #: a streamed reply must equal the non-streamed one
    streamed: bool = True
    replay: list[str] = Field(default=DEFAULT_REPLAY, max_length=64)
    #: the replies' length (tokens) for the gates and the replay
    max_tokens: int = Field(default=32, ge=1, le=4096)
    #: the engine returns the token ids (``"return_token_ids": true``, as vLLM does); else token_sha is
    #: taken over the text
    token_ids: bool = True
    #: JSON merged into every request (the lane's way to turn thinking off, say)
    request: dict[str, Any] = {}
    #: JSON merged into the reasoning gate's request (the lane's way to turn thinking on)
    reasoning_request: dict[str, Any] = {}
    #: the decode check (none: no speed is measured)
    speed: Speed | None = None
    #: seconds each request may take
    timeout: int = Field(default=120, ge=1, le=3600)


class Lane(Strict):
    #: the lane whose keys this one starts from (tables merged key by key, anything else replaced;
    #: builder.inputs.pins.expand_lanes)
    based_on: Name | None = None
    image: Name
    models: list[Name] = []
    serve: Serve
    env: Env = {}
    mounts: list[Mount] = []
    options: Options = Options()
    roles: Roles = Roles()
    ranks: dict[str, Run] = {}
    start: Literal["workers-first", "workers-in-rank-order", "head-first"] = "workers-first"
    start_timeout: int = Field(default=600, ge=1, le=7200)
    health: str = Field(default="/health", pattern=r"^/[A-Za-z0-9_./-]*$")
    #: what a release of the lane must answer (none: the serving audit asks /health, /v1/models, one token).
    #: Not part of the lane's identity in the lock (excluded from its dump): it judges what a release
    #: answers and changes nothing that is built, bundled or run.
    gates: Gates | None = Field(default=None, exclude=True)
    derivations: dict[Name, Derivation] = {}
    #: before a rank starts on a GPU host: sync, drop the page cache, and refuse while MemAvailable is
    #: below this many GiB (the vLLM launcher's MIN_AVAIL_GB)
    min_available_gib: int | None = Field(default=None, ge=1, le=4096)
    #: what the recipe does not say (shown by `builder launch`; never filled in with a guess)
    unknown: list[str] = []
    note: str | None = None

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, v: dict[str, Run]) -> dict[str, Run]:
        for k in v:
            if not k.isdigit() or int(k) > 63:
                raise ValueError(f"ranks.{k}: want a rank number (0 to 63)")
        return v

    @model_validator(mode="after")
    def _whole(self) -> Lane:
        for where, run in self.runs():
            if where.startswith("roles.") and run.ready is None:
                raise ValueError(f"{where}.ready: missing (how is this rank known to be up?)")
            for i, m in enumerate(run.mounts):
                if m.kind == "model" and m.name not in self.models:
                    raise ValueError(f"{where}.mounts[{i}].source: model {m.name!r} is not in this lane's models")
                if m.kind == "derived" and m.name not in self.derivations:
                    raise ValueError(f"{where}.mounts[{i}].source: no derivation {m.name!r} in this lane")
        for dname, d in self.derivations.items():
            for i, m in enumerate(d.mounts):
                if m.kind == "model" and m.name not in self.models:
                    raise ValueError(f"derivations.{dname}.mounts[{i}].source: model {m.name!r} is not in this "
                                     "lane's models")
        for i, m in enumerate(self.mounts):
            if m.kind == "model" and m.name not in self.models:
                raise ValueError(f"mounts[{i}].source: model {m.name!r} is not in this lane's models")
            if m.kind == "derived" and m.name not in self.derivations:
                raise ValueError(f"mounts[{i}].source: no derivation {m.name!r} in this lane")
        return self

    def runs(self) -> list[tuple[str, Run]]:
        out = [("roles.head", self.roles.head)]
        if self.roles.worker is not None:
            out.append(("roles.worker", self.roles.worker))
        out += [(f"ranks.{k}", r) for k, r in sorted(self.ranks.items(), key=lambda kv: int(kv[0]))]
        return out

    def replaced_targets(self) -> list[str]:
        """The image paths this lane's mounts replace (``replaces = true``), in order of first mention."""
        seen: list[str] = []
        for m in [*self.mounts, *(m for _, r in self.runs() for m in r.mounts)]:
            if m.replaces and m.target not in seen:
                seen.append(m.target)
        return seen

    def inputs(self) -> list[str]:
        """The runtime inputs (``input:NAME``) any rank mounts, in order of first mention."""
        seen: list[str] = []
        mounts = [*self.mounts, *(m for _, r in self.runs() for m in r.mounts)]
        for m in mounts:
            if m.kind == "input" and m.name not in seen:
                seen.append(m.name)
        for d in self.derivations.values():
            for m in d.mounts:
                if m.kind == "input" and m.name not in seen:
                    seen.append(m.name)
        return seen
