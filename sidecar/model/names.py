"""The one rule for the names an owner is made of, applied where a name comes in and where it is read back.

The edge holds every name of a request to it (``sidecar.edge.decode``), and the record decoder, so
``records verify`` and ``Recover``, hold every owner a record stores to it (``owner_fault``): a record
whose owner no request could have named could be released by no call (a ``Release`` naming its uid
is refused first), so it is corrupt, the operator's, and its instance is left as it is.

Names are held to Kubernetes' own limits, because a name is stored in a record and repeated in every
GetState: a pod UID of at most 128 bytes, a namespace that is a DNS label (at most 63; empty: not
told), a pod name of at most 253 bytes and a container name of at most 63. A claim is held to the
same: its uid as strict as a pod's, its namespace a DNS label, its name a DNS subdomain (at most
253), and each device's request a DRA request name. Each ``*_fault`` says what is wrong with a
value ("" when nothing is), quoting it through ``quote_clipped`` so the reason never grows with it.
"""

from __future__ import annotations

import re

from sidecar.model.domain import POD_UID_RE, REQUEST_NAME_RE, Owner, OwnerKind

MAX_POD_UID_BYTES = 128
MAX_NAMESPACE_BYTES = 63
MAX_POD_NAME_BYTES = 253
MAX_CONTAINER_NAME_BYTES = 63
MAX_CLAIM_NAME_BYTES = 253
MAX_REQUEST_NAME_BYTES = 127  # two DNS labels and the "/" between them
MAX_INDEX = 2**32 - 1  # a container or device index is the contract's uint32
QUOTE_CHARS = 64
DNS_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def quote_clipped(value: str, limit: int = QUOTE_CHARS) -> str:
    """``value`` quoted as ``ascii()`` does (no control or non-ASCII bytes reach a message), cut to
    about ``limit`` characters with its full length said, so a quote never grows with the input."""
    quoted = ascii(value)
    if len(quoted) <= limit:
        return quoted
    return f"{quoted[:limit]}... ({len(value)} characters)"


def fits(value: str, limit: int) -> bool:
    """Whether ``value`` is at most ``limit`` bytes in UTF-8 (no character passes 4 bytes)."""
    return len(value) <= limit // 4 or len(value.encode()) <= limit


def too_long(value: str, limit: int, what: str) -> str:
    return f"{what} is {len(value.encode())} bytes, more than {limit}: {quote_clipped(value)}"


def uid_fault(value: str, what: str = "pod") -> str:
    """A pod's uid, or (``what`` "claim") a claim's, held to the same rule."""
    if not value:
        return f"{what} uid is missing"
    if not fits(value, MAX_POD_UID_BYTES):
        return too_long(value, MAX_POD_UID_BYTES, f"{what} uid")
    if not POD_UID_RE.fullmatch(value):
        return f"{quote_clipped(value)} is not a {what} UID"
    return ""


def namespace_fault(value: str, what: str) -> str:
    """An empty namespace is "not told" (grpcurl, older clients); a given one must be a real one."""
    if not fits(value, MAX_NAMESPACE_BYTES):
        return too_long(value, MAX_NAMESPACE_BYTES, f"{what} namespace")
    if value and not DNS_LABEL_RE.fullmatch(value):
        return f"{what} namespace {quote_clipped(value)} is not a DNS label"
    return ""


def pod_name_fault(value: str) -> str:
    return too_long(value, MAX_POD_NAME_BYTES, "pod name") if not fits(value, MAX_POD_NAME_BYTES) else ""


def container_name_fault(value: str) -> str:
    if not fits(value, MAX_CONTAINER_NAME_BYTES):
        return too_long(value, MAX_CONTAINER_NAME_BYTES, "container name")
    return ""


def claim_name_fault(value: str) -> str:
    """A claim's name, when told: a DNS subdomain."""
    if not fits(value, MAX_CLAIM_NAME_BYTES):
        return too_long(value, MAX_CLAIM_NAME_BYTES, "claim name")
    if value and not DNS_SUBDOMAIN_RE.fullmatch(value):
        return f"claim name {quote_clipped(value)} is not a DNS subdomain"
    return ""


def request_name_fault(value: str) -> str:
    """The claim's request a device answers: required, a DRA request name (a DNS label, or two
    joined by "/" for a subrequest)."""
    if not value:
        return "request is missing (a claim's device names the request it answers)"
    if not fits(value, MAX_REQUEST_NAME_BYTES) or not REQUEST_NAME_RE.fullmatch(value):
        return f"{quote_clipped(value)} is not a DRA request name (a DNS label, or two joined by /)"
    return ""


def owner_fault(owner: Owner) -> str:
    """Why no request could have named ``owner`` ("" when one could): it is neither a pod's nor a
    claim's (``Owner.inconsistency``), a name breaks the rule above, or an index is no uint32."""
    why = owner.inconsistency()
    if why:
        return why
    if owner.kind is OwnerKind.CLAIM:
        assert owner.claim is not None  # inconsistency() says so otherwise
        claim = owner.claim
        faults = (
            uid_fault(claim.uid, "claim"),
            namespace_fault(claim.namespace, "claim"),
            claim_name_fault(claim.name),
            request_name_fault(owner.request),
        )
    else:
        pod = owner.pod
        faults = (
            uid_fault(pod.uid),
            namespace_fault(pod.namespace, "pod"),
            pod_name_fault(pod.name),
            container_name_fault(owner.container_name),
        )
    for index, value in (("container_index", owner.container_index), ("device_index", owner.device_index)):
        if not 0 <= value <= MAX_INDEX:
            return f"{index} {value} is out of range 0..{MAX_INDEX}"
    return next((fault for fault in faults if fault), "")
