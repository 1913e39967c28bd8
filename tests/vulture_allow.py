"""Names vulture reports as unused that are used all the same: called by a framework, read by name or
through a serialised form. vulture reads this file with the code (pyproject.toml's [tool.vulture]); a name
written here counts as used everywhere. Each line says who uses it. Not imported by anything.

Run: ``python3 -m vulture`` (.ci/run's lint step and tests/test_deadcode.py do).
"""
# ruff: noqa: B018, F821

# pydantic calls these: the validators of builder/inputs (decorated @field_validator / @model_validator)
_._ipv4, _._absolute, _._ssh_target, _._registry_url, _._ranks, _._models_need_registry  # builder/inputs/hosts.py
_._ulimits, _._caps, _._one, _._output, _._inputs_only, _._whole  # builder/inputs/lanes.py (and a _ranks)
_._relative, _._known_platforms, _._in_images, _._by_digest  # builder/inputs/pins.py (_inside: used elsewhere)
_._one_origin, _._one_kind_of_image, _._references  # builder/inputs/pins.py
model_config  # pydantic reads a model's settings from this class attribute

# schema fields written out as JSON (pins.lock; the host's expectations the checks/ suite reads as a dict)
generated  # pins.lock's `_generated` header line
inputs_hash  # pins.lock's hash of the inputs (docs/lock.md)
enabled, timeout_s  # hosts/*.toml burn gate: checks/test_burn.py reads burn["enabled"], burn["timeout_s"]
gpu_clock_mhz  # expect.gpu_clock_mhz, read by checks/test_gpu.py
min_free_memory_gib, max_swap_used_gib, memory_wait_s  # expect.*, read by checks/test_memory.py
min_free_disk_gib, nfs_mounts  # expect.*, read by checks/test_storage.py
rdma  # expect.rdma, read by checks/test_fabric.py
# a lane's gates (builder/inputs/lanes.py Gates), sent as JSON to builder/hostscripts/gates.py on the head
arguments, aliases, reasoning_request, tolerance  # gates.py and checks/test_gates.py read them by key

# attributes another library reads or methods it calls
_.create_system  # zipfile: the ZipInfo's system, so that external_attr is read as a unix mode
_.readable  # io.RawIOBase: BufferedReader asks its raw stream
_.list_commands, _.get_command, _.format_commands  # click.Group: click calls these to list and load commands
_.desc, _.disable, _.format_dict  # huggingface_hub's tqdm-like progress object: the hub reads these
_.update_transfer, _.set_postfix_str, _.set_transfer_postfix_str, _.set_description  # ... and calls these
_.rollback_audit  # builder/deploy/report.py serialises it with attrs(self, ..., "rollback_audit")

# pytest: hooks and marks found by name, fixtures requested by parameter name (autouse ones by no one)
pytest_addoption, pytest_configure, pytest_collection_modifyitems, pytest_runtest_setup
pytest_runtest_call, pytest_runtest_makereport, pytest_sessionstart, pytest_sessionfinish
pytest_runtest_logreport, pytest_terminal_summary
pytestmark  # a module's tier marks
_isolated_env, _ssh_connections, _needs_the_registry, _prefetch, _quick_retries  # autouse fixtures
bystanders, small_disk, network_refused  # fixtures a test requests for their effect, not their value

# tests' stand-ins served to real clients
# http.server's BaseHTTPRequestHandler dispatches by name
_.do_GET, _.do_HEAD, _.do_POST, _.do_PUT, _.do_PATCH, _.log_message
protocol_version, _.daemon_threads  # http.server: keep-alive HTTP/1.1, threads that end with the test
_.keyid  # securesystemslib: the signer's key id, written into the DSSE envelope it signs
# tests/lib/vllm_conformance.py: the platform and model vLLM calls, with vLLM's parameter names
_.current_platform, _.pre_tokenizer, _.get_device_capability, _.get_device_total_memory, _.is_fully_connected
_.get_device_numa_node, _.get_all_device_numa_nodes, _.embed_input_ids, _.compute_logits
device_id, physical_device_ids, vllm_config, input_ids, positions, intermediate_tensors, inputs_embeds
hidden_states

