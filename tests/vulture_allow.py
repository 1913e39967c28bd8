"""Names in builder/ and checks/ that vulture reports as unused, used all the same: called by a framework,
read by name or through a serialised form. vulture reads this file with builder/ and checks/ only
(pyproject.toml's [tool.vulture]), so code that only the tests or the benchmarks use counts as dead; a
name written here counts as used everywhere. Each line says who uses it. Not imported by anything.

Run: ``python3 -m vulture`` (.ci/run's lint step and tests/test_deadcode.py do).
"""
# ruff: noqa: B018, F821

# pydantic calls these: the validators of builder/inputs (decorated @field_validator / @model_validator)
_._ipv4, _._absolute, _._ssh_target, _._registry_url, _._ranks, _._models_need_registry  # builder/inputs/hosts.py
_._ulimits, _._caps, _._one, _._output, _._inputs_only, _._whole  # builder/inputs/lanes.py (and a _ranks)
_._relative, _._known_platforms, _._in_images, _._by_digest  # builder/inputs/pins.py (_inside: used elsewhere)
_._one_origin, _._one_kind_of_image, _._references  # builder/inputs/pins.py
model_config  # pydantic reads a model's settings from this class attribute
based_on  # pins.toml's lanes.X.based_on: expand_lanes reads the raw table; the field types it for the strict Lane

# schema fields written out as JSON (pins.lock; the host's expectations the checks/ suite reads as a dict)
generated  # pins.lock's `_generated` header line
builder  # pins.lock's `builder` key: the version that wrote it (docs/lock.md)
inputs_hash  # pins.lock's hash of the inputs (docs/lock.md)
enabled, timeout_s  # hosts/*.toml burn gate: checks/test_burn.py reads burn["enabled"], burn["timeout_s"]
gpu_clock_mhz  # expect.gpu_clock_mhz, read by checks/test_gpu.py
min_free_memory_gib, max_swap_used_gib, memory_wait_s  # expect.*, read by checks/test_memory.py
min_free_disk_gib, nfs_mounts  # expect.*, read by checks/test_storage.py
rdma  # expect.rdma, read by checks/test_fabric.py
locked_files  # PlacedModel.to_json writes it by name; checks/test_models.py reads m["locked_files"]
# a lane's gates (builder/inputs/lanes.py Gates), sent as JSON to builder/hostscripts/gates.py on the head
arguments, aliases, reasoning_request, tolerance  # gates.py and checks/test_gates.py read them by key
reasoning, draft_switch, concurrent, token_ids  # gates.py reads g["reasoning"], g["draft_switch"], ... by key
# BurnResult.reasons: asdict() writes it into the burn's facts, shown in `builder audit --json`
reasons

# nvidia-smi --query-gpu fields, set by name into GpuInfo (builder/gpu/fields.py FIELD_MAP, parse.py _row); the
# model forbids unknown keys, so each field the query asks for must be one
pci_bus_id, vbios_version, pstate, clocks_mem_mhz, clocks_max_mem_mhz, memory_used_mib, memory_free_mib
clocks_applications_graphics_mhz, clocks_applications_memory_mhz, clocks_default_applications_graphics_mhz
ecc_mode, mig_mode, power_limit_w

# attributes another library reads or methods it calls
_.create_system  # zipfile: the ZipInfo's system, so that external_attr is read as a unix mode
_.compress_type  # zipfile: the ZipInfo's compression, read as the entry is written
_.uname, _.gname  # tarfile: the TarInfo's owner names, written into each entry's header
_.readable  # io.RawIOBase: BufferedReader asks its raw stream
_.list_commands, _.get_command, _.format_commands  # click.Group: click calls these to list and load commands
_.render  # rich: a ProgressColumn draws its cell by render(task)
_.desc, _.disable, _.format_dict  # huggingface_hub's tqdm-like progress object: the hub reads these
_.update_transfer, _.set_postfix_str, _.set_transfer_postfix_str  # ... and calls these (its Xet downloads)
_.rollback_audit  # builder/deploy/report.py serialises it with attrs(self, ..., "rollback_audit")

# pytest: hooks and fixtures of checks/conftest.py, found by name (autouse ones requested by no one)
pytest_addoption, pytest_configure, pytest_runtest_setup, pytest_runtest_call, pytest_runtest_makereport
pytest_sessionstart, pytest_sessionfinish, pytest_collectreport
_prefetch  # autouse fixture
