"""Every repository path, code symbol, flag and make target the documentation names in backticks exists.

Documentation rots by naming things that were renamed or removed (the README once mapped
``lifecycle.py`` and ``books`` long after both were gone). This test reads the inline code spans of
``README.md``, ``docs/*.md``, ``bench/README.md``, ``bench/HISTORY.md`` and
``integration/goclient/README.md`` (fenced blocks are examples, not references, and are skipped) and
sorts each span by its shape, with one rule per shape:

- ``make X``: ``X`` is a target in the ``Makefile``.
- ``--flag`` (a first word starting with two dashes): the flag appears as a quoted string in a Python
  file of the repository (``sidecar/config/flags.py``'s table, ``sidecar/cli.py``, a ``bench/`` script's
  parser) or as a Go ``flag`` name.
- ``HAMI_MIG_SIDECAR_X``: the environment twin of a flag ``--x`` (``sidecar/config/flags.py``'s rule), or
  a variable a source file spells out (``HAMI_MIG_SIDECAR_CRASH_AT``).
- a relative path (ends in a file extension, or starts with a folder the repository has; no spaces or
  placeholders): the file or directory exists at the root, beside the document, or as the tail of a
  tracked path (``model/hami_takeover.py`` is ``sidecar/model/hami_takeover.py``).
- a code symbol: any identifier (``books``, ``EnsureAllocation``, ``sync_active``) or dotted name
  (``hami.Manager.Release``), optionally followed by a call's parentheses, except a single word in
  capitals (``ACTIVE``, ``HAMI``: a state or output, said in prose). Each of its parts is defined in
  the repository: a Python ``def``, ``class``, assigned name or field; a Go ``func``, method,
  parameter, ``type``, ``const``, ``var``, struct field or interface method; a proto ``message``,
  ``enum``, ``rpc``, field or enum value; a module or package name. Names that are data rather than
  code count when the sources spell them: a string literal (the error reason ``PLACEMENT_BUSY``, the
  CDI key ``cdiVersion``), a word of a deployment YAML file (the alert ``HamiMigSidecarStuck``), a
  metric ``hami_mig_sidecar_X`` whose ``_X`` the sources write. ``nvml...`` names are looked up in the
  installed NVML binding, and a dotted name whose first part is an installed module that is not ours
  (``time.perf_counter_ns``) must resolve by import. A name the document defines in its own code block
  (the patch ``docs/porting-hami.md`` shows) counts too.

Anything else (prose words, absolute host paths such as ``/var/run/cdi``, commands, JSON, Go module paths,
annotation keys) is not checked. Names that belong to other code (HAMi's Go sources, which the HAMi
documents compare against, go-nvml, the CDI library, the standard libraries) are listed in ``FOREIGN``
with their owner, so a name that is neither ours nor listed fails; a listed name must still be named by a
document and must not be one of ours, so the list does not outlive its use.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

import pynvml

import sidecar

REPO = Path(sidecar.__file__).parent.parent
DOC_GLOBS = (
    "README.md",
    "docs/*.md",
    "bench/README.md",
    "bench/HISTORY.md",
    "integration/goclient/README.md",
)

# Names the documents mention that are defined outside this repository, by owner.
FOREIGN: dict[str, frozenset[str]] = {
    # HAMi release-v2.10 (the device plugin and scheduler the HAMi documents compare against).
    "hami": frozenset(
        {
            "AddResourceUsage",
            "CheckHealth",
            "ComputeScore",
            "CustomFilterRule",
            "CustomInfo",
            "DeviceUsageList",
            "Fit",
            "findMigUUIDForGI",
            "GetContainerDeviceStrArray",
            "GetNodeDevices",
            "Init",
            "InitNvidiaDevice",
            "Less",
            "MigInstanceManager",
            "MigPlacement",
            "NvidiaConfig",
            "NvidiaGPUDevices",
            "PodAllocationSuccess",
            "ReleaseNodeLock",
            "annotateMigRuntimeInfo",
            "devicePluginForResource",
            "filterdevices",
            "fitInDevices",
            "getAllocateResponse",
            "kubernetesAllocatedMigGPUs",
            "migAllocationKey",
            "migAllocationRuntimeInfo",
            "migInstance",
            "migProfileAllowlist",
            "newTestPlugin",
            "nodeConfiguration",
            "nvidiaNodeSelector",
            "orderedMigPlacements",
            "podAllocationTrySuccess",
            "primeMigManagerFromAnnotations",
            "ReportedRegisterAnnos",
            "runMigAnnotationReconciler",
            "selectMigPlacement",
            "setupFakeClient",
            "spread",
            "updateResponseForCDI",
            "device.go",
            "mig_topology.go",
            "mig_topology_test.go",
            "mig_idle_test.go",
            "mig_startup.go",
            "migmgr.go",
            "migmgr_sidecar_test.go",
            "nodelock",
            "server.go",
            "server_test.go",
            "util.go",
            "pkg/device/nvidia/device.go",
            "pkg/device/nvidia/mig_topology.go",
            "pkg/scheduler/policy/gpu_policy.go",
            "pkg/scheduler/score.go",
        }
    ),
    # HAMi master after v2.10 (#2855, the scored placements).
    "hami-master": frozenset({"newMigLayout"}),
    # Names docs/porting-hami.md's port adds to HAMi's plugin (aliases of this repository's types).
    "ported-plugin": frozenset({"migAllocationResult", "migOwnershipRecord"}),
    # go-nvml, the CDI reference library, kubelet, the Go toolchain and standard library, googleapis.
    "go": frozenset(
        {
            "GpuInstancePlacement",
            "NodePrepareResources",
            "NodeUnprepareResources",
            "NotifyRegistrationStatus",
            "GetGpuInstances",
            "ReadSpec",
            "InjectDevices",
            "DevicePluginCDIDevices",
            "As",
            "ErrorInfo",
            "go.work",
            "go.work.sum",
        }
    ),
    # Python's standard library and the packages the sidecar and its tests use.
    "python": frozenset(
        {
            "Condition",
            "notify_all",
            "add_callback",
            "get_sample_value",
            "isoformat",
        }
    ),
    # Flags of other tools (helm).
    "flags": frozenset({"--set"}),
    # System calls and commands of the operating system.
    "os": frozenset({"dmesg", "fstat", "fsync", "flock"}),
}

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
# A code span may wrap onto the next line of its paragraph (never across a blank line).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n)[^`]|`(?!\1))+?)(?<!`)\1(?!`)")
EXTENSIONS = (
    ".py",
    ".go",
    ".md",
    ".toml",
    ".yaml",
    ".yml",
    ".json",
    ".proto",
    ".pyi",
    ".png",
    ".txt",
    ".mod",
    ".sum",
    ".work",
)
TOP_LEVEL_DOMAINS = ("io", "com", "org", "dev", "net")
PLACEHOLDER = re.compile(r"[<>*…{}$\[\]]|\.\.\.")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
SYMBOL = re.compile(rf"^(?P<name>{IDENT}(?:\.{IDENT})*)(?:\(.*\))?$")
ENV = re.compile(r"^HAMI_MIG_SIDECAR_[A-Z0-9_]+$")


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOC_GLOBS for p in REPO.glob(pattern)})


def code_spans(text: str) -> Iterator[str]:
    """The inline code spans of a Markdown text, outside fenced blocks, stripped of padding."""
    for match in CODE_SPAN.finditer(FENCE.sub("", text)):
        span = " ".join(match.group(2).split())
        if span:
            yield span


@cache
def tracked() -> tuple[str, ...]:
    git = shutil.which("git")
    assert git is not None, "the tracked files are listed by git"
    out = subprocess.run([git, "ls-files"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    return tuple(out.split())


@cache
def tracked_dirs() -> frozenset[str]:
    return frozenset(str(parent) for f in tracked() for parent in Path(f).parents if str(parent) != ".")


def source_files(*suffixes: str) -> list[Path]:
    """The tracked sources, less generated code and this file (its made-up names must stay made up)."""
    return [
        REPO / f
        for f in tracked()
        if f.endswith(suffixes) and not f.endswith("_pb2.py") and REPO / f != Path(__file__)
    ]


def python_names(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        yield leaf.id
                    elif isinstance(leaf, ast.Attribute):
                        yield leaf.attr


GO_FUNC = re.compile(rf"^func\s+(?:\([^)]*\)\s*)?({IDENT})", re.MULTILINE)
GO_TYPE = re.compile(rf"^\s*type\s+({IDENT})", re.MULTILINE)
GO_SINGLE = re.compile(rf"^(?:const|var)\s+({IDENT})", re.MULTILINE)
GO_BLOCK = re.compile(
    r"^(const|var|type \w+ (?:struct|interface)) ?\(?\{?\s*$(.*?)^[)}]", re.MULTILINE | re.DOTALL
)
GO_PARAMS = re.compile(r"^func\s+(?:\([^)]*\)\s*)?\w+\(([^)]*)\)", re.MULTILINE)
GO_MEMBER = re.compile(rf"^\t({IDENT}(?:,\s*{IDENT})*)\b", re.MULTILINE)  # Poll, Refresh time.Duration
PROTO = re.compile(rf"^\s*(?:message|enum|rpc|service)\s+({IDENT})|({IDENT})\s*=\s*\d+\s*[;\[]", re.MULTILINE)


def go_names(text: str) -> Iterator[str]:
    yield from GO_FUNC.findall(text)
    yield from GO_TYPE.findall(text)
    yield from GO_SINGLE.findall(text)
    for params in GO_PARAMS.findall(text):
        yield from re.findall(rf"(?:^|,)\s*({IDENT})", params)
    for _, body in GO_BLOCK.findall(text):
        for names in GO_MEMBER.findall(body):
            yield from re.split(r",\s*", names)


@cache
def defined() -> frozenset[str]:
    """Every name the repository defines, in Python, Go or the proto, plus module and package names."""
    names: set[str] = set()
    for path in source_files(".py", ".pyi"):
        names.update(python_names(ast.parse(path.read_text())))
    for path in source_files(".go"):
        names.update(go_names(path.read_text()))
    for path in source_files(".proto"):
        for message, field in PROTO.findall(path.read_text()):
            names.add(message or field)
    names.update(Path(f).stem for f in tracked())
    names.update(Path(d).name for d in tracked_dirs())
    return frozenset(names)


# A Go flag definition: fs.BoolVar(&cfg.recoverPending, "recover-pending", ...) or flag.String("json", ...).
GO_FLAG = re.compile(
    r"""\.(?:Bool|String|Int|Int64|Uint|Duration|Float64)(?:Var)?\((?:&[\w.]+,\s*)?"([a-z][\w-]*)\""""
)


@cache
def quoted_flags() -> frozenset[str]:
    flags: set[str] = set()
    for path in source_files(".py", ".go"):
        flags.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", path.read_text()))
        flags.update("--" + f for f in GO_FLAG.findall(path.read_text()))
    return frozenset(flags)


@cache
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", text, re.MULTILINE))


@cache
def spelled_out() -> str:
    return "\n".join(p.read_text() for p in source_files(".py", ".go", ".yaml"))


@cache
def foreign() -> frozenset[str]:
    return frozenset().union(*FOREIGN.values())


def looks_like_path(span: str) -> bool:
    """A relative path: ends in a file extension, or starts with a folder the repository has.

    ``on/off``, ``k8s.io/api`` (a Go module), ``hami.io/vgpu-mig-allocations`` (an annotation) and
    ``grpc.health.v1.Health/Check`` (a method) are not paths: their first part is no folder here and
    they name no file."""
    if " " in span or span.startswith(("/", "~", "-", "+", ".")) or PLACEHOLDER.search(span):
        return False
    if re.fullmatch(r"[\w./-]+", span) is None:
        return False
    if re.search(r"/v(\d|X)", span):
        return False  # a Go module's release tag (api/v0.1.0)
    first = span.split("/", maxsplit=1)[0]
    if "/" in span and "." in first:
        return False
    return span.endswith(EXTENSIONS) or ("/" in span and first in top_level_and_dirs())


@cache
def top_level_and_dirs() -> frozenset[str]:
    return frozenset(Path(d).name for d in tracked_dirs()) | {f.split("/")[0] for f in tracked()}


def path_exists(span: str, doc: Path) -> bool:
    rel = span.rstrip("/")
    if (REPO / rel).exists() or (doc.parent / rel).exists():
        return True
    tail = "/" + rel
    return any(("/" + f).endswith(tail) for f in (*tracked(), *tracked_dirs()))


def is_symbol(name: str) -> bool:
    """Any identifier but a single word in capitals, which is prose or output (``HAMI``, ``LIST``)."""
    return "." in name or "_" in name.strip("_") or not name.isupper()


def problem(span: str, doc: Path) -> str | None:
    """Why ``span`` names something that does not exist, or None when it exists or is not a name."""
    words = span.split()
    if words[0] == "make" and len(words) == 2:
        return None if words[1] in make_targets() else f"no make target {words[1]!r}"
    if span.startswith("--"):
        flag = re.match(r"--[a-z][a-z0-9-]*", span)
        if flag is None or flag.group(0) in quoted_flags() or flag.group(0) in foreign():
            return None
        return f"no flag {flag.group(0)!r} in the sources"
    if ENV.match(span):
        twin = "--" + span.removeprefix("HAMI_MIG_SIDECAR_").lower().replace("_", "-")
        return None if twin in quoted_flags() or span in spelled_out() else f"no flag {twin!r} for {span!r}"
    if looks_like_path(span):
        return None if span in foreign() or path_exists(span, doc) else f"no path {span!r}"
    match = SYMBOL.match(span)
    if match is None:
        return None
    parts = match.group("name").split(".")
    if not is_symbol(match.group("name")) or ENV.match(parts[-1]):
        return None
    if parts[-1] in TOP_LEVEL_DOMAINS or any(re.fullmatch("[A-Z]", p) for p in parts):
        return None  # a host or API group (migsidecar.hami.io), or a placeholder (X.Y.Z)
    if importable(match.group("name")):
        return None
    missing = [p for p in parts if not name_exists(p, doc)]
    return f"{'.'.join(parts)}: {', '.join(missing)} not defined" if missing else None


@cache
def quoted() -> frozenset[str]:
    """The identifier-like string literals of the sources: error reasons, JSON keys, env names."""
    found: set[str] = set()
    for path in source_files(".py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.update(re.findall(rf"^{IDENT}$", node.value))
    for path in source_files(".go"):
        found.update(re.findall(rf'"({IDENT})[,"]', path.read_text()))
    return frozenset(found)


@cache
def yaml_words() -> frozenset[str]:
    """The words of the deployment files: alert names, Kubernetes keys and values."""
    return frozenset(w for p in source_files(".yaml", ".yml") for w in re.findall(IDENT, p.read_text()))


@cache
def nvml_binding() -> str:
    """The NVML binding's source, which spells out the C API's names (``nvmlDeviceGetName``)."""
    return Path(pynvml.__file__).read_text()


@cache
def fence_names(doc: Path) -> frozenset[str]:
    """What the document's own code blocks define (a patch it shows: ``func newMigManager``)."""
    return frozenset(go_names("\n".join(m.group(0) for m in FENCE.finditer(doc.read_text()))))


def importable(dotted: str) -> bool:
    """``time.perf_counter_ns``, ``msgspec.Raw``: a module the environment has, and its attribute."""
    parts = dotted.split(".")
    if parts[0] in top_level_and_dirs() or importlib.util.find_spec(parts[0]) is None:
        return False  # the repository's own names are looked up in its sources, not imported
    target: object = importlib.import_module(parts[0])
    for part in parts[1:]:
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


def name_exists(name: str, doc: Path) -> bool:
    if name in defined() or name in quoted() or name in yaml_words() or name in foreign():
        return True
    if importable(name):
        return True
    if name.startswith("nvml"):
        return re.search(rf"\b{name}\b", nvml_binding()) is not None
    metric = re.fullmatch(r"hami_mig_sidecar_(\w+?)(_total)?", name)
    if metric is not None and f'_{metric.group(1)}"' in spelled_out():
        return True
    return name in fence_names(doc)


def problems(text: str, doc: Path) -> list[str]:
    return [found for span in code_spans(text) if (found := problem(span, doc)) is not None]


def all_problems(docs: Iterable[Path]) -> list[str]:
    return [f"{doc.relative_to(REPO)}: {p}" for doc in docs for p in problems(doc.read_text(), doc)]


def test_the_documents_are_found() -> None:
    found = {str(p.relative_to(REPO)) for p in doc_files()}
    assert {"README.md", "bench/README.md", "docs/architecture.md"} <= found


def test_every_name_the_documents_give_exists() -> None:
    assert all_problems(doc_files()) == []


def test_every_foreign_name_is_named_by_a_document_and_is_not_ours() -> None:
    """The list of foreign names shrinks with the documents and never hides a name of ours."""
    spans = {s for doc in doc_files() for s in code_spans(doc.read_text())}
    parts = {p for s in spans for p in re.split(r"[.()\s,]+", s) if p} | spans
    assert sorted(foreign() - parts) == []
    assert sorted(n for n in foreign() if n in defined() or (REPO / n).exists()) == []


def test_the_checker_catches_made_up_names_and_passes_real_ones() -> None:
    doc = REPO / "README.md"
    sample = (
        "Real: `sidecar/edge/server.py`, `deploy/helm/post-render`, `bench/trace.py`, `hami.Manager.Release`,"
        " `register.EncodeIdle`, `Liveness.waiting`, `--idle-ttl SECONDS`, `HAMI_MIG_SIDECAR_IDLE_TTL`,"
        " `make run-sim`, `sync_active`, `time.perf_counter_ns`, `pkg/scheduler/score.go`.\n"
        "Not names: `on/off`, `k8s.io/api`, `/var/run/cdi`, `api/v0.1.0`, `migsidecar.hami.io`, `NOWHERE`.\n"
        "```\n`sidecar/in_a_fence.py`\n```\n"
        "Made up: `sidecar/lifecycle.py`, `hami.Manager.Rel3ase`, `register.EncodeIdel(state,\n  blocked)`,"
        " `--no-such-flag`, `HAMI_MIG_SIDECAR_NO_SUCH`, `make no-such-target`, `books`,"
        " `Nonexistent.waiting`."
    )
    assert problems(sample, doc) == [
        "no path 'sidecar/lifecycle.py'",
        "hami.Manager.Rel3ase: Rel3ase not defined",
        "register.EncodeIdel: EncodeIdel not defined",
        "no flag '--no-such-flag' in the sources",
        "no flag '--no-such' for 'HAMI_MIG_SIDECAR_NO_SUCH'",
        "no make target 'no-such-target'",
        "books: books not defined",
        "Nonexistent.waiting: Nonexistent not defined",
    ]
