"""Running nvidia-smi: the probe (one ``--query-gpu`` call, the versions, the compute apps; an older
driver's field list when the full one is refused), here or through any runner (the audit's testinfra)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

from builder.gpu.fields import FALLBACK_FIELDS, QUERY_FIELDS
from builder.gpu.parse import compute_apps_command, parse_compute_apps, parse_query, parse_version, query_command
from builder.gpu.readings import GpuReport
from builder.gpu.values import BAD_FIELD_RE, GpuError, check_failure, shown

#: run(argv) -> (exit status, stdout, stderr); lets the audit run the same probe over testinfra.
Runner = Callable[[list[str]], tuple[int, str, str]]


def probe_commands(nvidia_smi: str = "nvidia-smi") -> list[list[str]]:
    """What :func:`probe` runs when nothing fails: the GPU query, the versions, the compute apps."""
    return [query_command(QUERY_FIELDS, nvidia_smi), [nvidia_smi, "--version"], compute_apps_command(nvidia_smi)]


def probe(run: Runner, nvidia_smi: str = "nvidia-smi") -> GpuReport:
    """Query every GPU (falling back to :data:`FALLBACK_FIELDS`), the versions and the compute apps."""
    query, version, apps_cmd = probe_commands(nvidia_smi)
    fields, fallback = list(QUERY_FIELDS), False
    rc, out, err = run(query)
    if rc != 0 and BAD_FIELD_RE.search(out + err):
        fields, fallback = list(FALLBACK_FIELDS), True
        rc, out, err = run(query_command(fields, nvidia_smi))
    if rc != 0:
        check_failure(out + "\n" + err, "--query-gpu")
        raise GpuError(f"nvidia-smi --query-gpu: exit status {rc}: {_first_line(err or out)}")
    gpus = parse_query(out, fields)

    rc, vout, verr = run(version)
    if rc != 0:  # drivers before ~525 have no --version: read the summary table header
        rc, vout, verr = run([nvidia_smi])
        if rc != 0:
            raise GpuError(f"nvidia-smi: exit status {rc}: {_first_line(verr or vout)}")
    versions = parse_version(vout)

    rc, aout, aerr = run(apps_cmd)
    if rc != 0:
        raise GpuError(f"nvidia-smi --query-compute-apps: exit status {rc}: {_first_line(aerr or aout)}")
    apps = parse_compute_apps(aout)

    driver = versions["driver"] or next((g.driver_version for g in gpus if g.driver_version), None)
    return GpuReport(
        driver_version=driver,
        cuda_version=versions["cuda"],
        gpus=gpus,
        compute_apps=apps,
        fields=fields,
        fallback=fallback,
    )


def _first_line(text: str) -> str:
    for ln in text.splitlines():
        if ln.strip():
            return shown(ln.strip())[1:-1]
    return "(no output)"


def local_runner(timeout: float = 30.0) -> Runner:
    """A Runner that runs argv on this machine with a timeout; failures become GpuError."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            p = subprocess.run(
                argv, capture_output=True, text=True, errors="replace", timeout=timeout, check=False
            )
        except FileNotFoundError:
            raise GpuError(f"{argv[0]}: not found (is the NVIDIA driver installed?)") from None
        except subprocess.TimeoutExpired:
            raise GpuError(f"{argv[0]}: no answer within {timeout:g} s ({' '.join(argv[1:2])})") from None
        except OSError as e:
            raise GpuError(f"{argv[0]}: cannot run: {e.strerror}") from None
        return p.returncode, p.stdout, p.stderr

    return run


def probe_local(nvidia_smi: str = "nvidia-smi", timeout: float = 30.0) -> GpuReport:
    """Run nvidia-smi here and parse its report; GpuError when it is missing, hangs or fails."""
    path = shutil.which(nvidia_smi)
    if path is None:
        raise GpuError(f"{nvidia_smi}: not found on PATH (is the NVIDIA driver installed?)")
    return probe(local_runner(timeout), path)
