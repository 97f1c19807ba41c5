"""``records verify``: the offline check of a state directory (opens nothing for writing, no lock).

Kept apart from the store in ``records`` because it serves the CLI only; it reads through the same
decoders, so it judges a file exactly as the store does.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from sidecar.model.hami_takeover import read_record_file
from sidecar.model.ownership import OwnershipRecord
from sidecar.store import hami_records
from sidecar.store.record_format import GENERATION_FILE, CorruptRecord
from sidecar.store.records import SUFFIX, read_generation, scan


class VerifyReport(msgspec.Struct, frozen=True):
    """What ``verify`` found: valid record names, corrupt ones with the reason, stale ones, and ones
    without a boot ID.

    ``stale`` is a subset of ``valid``: records written in another boot (GI/CI do not survive a reboot,
    so their instances are gone; startup recovery drops them). ``no_boot_id`` is another subset of
    ``valid``, never stale: records with an empty ``boot_id``. The sidecar stamps the boot ID in every
    record it writes, so such a record was made or edited by hand; nothing tells which boot it
    belongs to, so startup recovery neither acts on it nor drops it - it keeps it aside, untouched,
    with the instance at its placement foreign - and the operator fixes or removes it."""

    directory: str
    valid: tuple[str, ...] = ()
    corrupt: dict[str, str] = msgspec.field(default_factory=dict)
    stale: tuple[str, ...] = ()
    no_boot_id: tuple[str, ...] = ()
    # The ``generation`` file's ceiling; None when it is missing or corrupt (then it is in ``corrupt``).
    generation_ceiling: int | None = None
    # Valid records of instances taken over from HAMi's in-process lifecycle (a subset of ``valid``).
    taken_over: tuple[str, ...] = ()
    # HAMi's ownership record files still here (file name -> what it is): recovery has not taken them
    # over, or kept them untouched because they do not decode or do not match the live instance.
    # Judging the match needs the hardware, which this offline check never opens; Recover's errors
    # say which contradiction kept a file.
    hami: dict[str, str] = msgspec.field(default_factory=dict)


def verify(directory: Path, boot_id: str | None) -> VerifyReport:
    """Offline check of a state directory for ``records verify``: opens nothing for writing, takes no lock.

    ``boot_id`` is the current boot id; None skips the staleness check (records without a boot ID are
    reported either way). Raises OSError (for example FileNotFoundError) when the directory cannot be
    listed, so a mistyped path is not reported as "no records, all fine"."""
    valid, corrupt = scan(directory)
    ceiling: int | None = None
    try:
        ceiling = read_generation(directory)
    except CorruptRecord as exc:
        corrupt[GENERATION_FILE] = exc
    # The rule startup recovery applies: an empty boot ID is not another boot, it is no boot at all.
    stale = tuple(
        name for name, rec in valid.items() if boot_id is not None and rec.boot_id and rec.boot_id != boot_id
    )
    return VerifyReport(
        directory=str(directory),
        valid=tuple(valid),
        corrupt={name: exc.why for name, exc in corrupt.items()},
        stale=stale,
        no_boot_id=tuple(name for name, rec in valid.items() if not rec.boot_id),
        generation_ceiling=ceiling,
        taken_over=tuple(name for name, rec in valid.items() if rec.taken_over_from),
        hami=_hami_files(directory, valid),
    )


def _hami_files(directory: Path, valid: dict[str, OwnershipRecord]) -> dict[str, str]:
    """What each HAMi ownership record file in ``directory`` is, as recovery would judge it offline."""
    holders = {rec.mig_uuid: name for name, rec in valid.items() if rec.mig_uuid}
    found: dict[str, str] = {}
    for filename, data in hami_records.record_files(directory):
        file = read_record_file(filename, data)
        record = file.record
        if record is None:
            found[filename] = f"not usable ({file.why}); recovery keeps it untouched, its instance foreign"
            continue
        what = (
            f"HAMi's record of {record.mig_uuid} ({record.profile} at {record.where} on "
            f"{record.parent_gpu_uuid}, GI {record.gpu_instance_id}, CI {record.compute_instance_id})"
        )
        holder = holders.get(record.mig_uuid)
        if holder is not None:
            found[filename] = (
                f"{what}; the sidecar's record {holder} holds it, the next Recover removes this file"
            )
        else:
            found[filename] = (
                f"{what}; not taken over: recovery converts it when the live instance matches it, "
                "and keeps it untouched, its instance foreign, when not (Recover's errors say why)"
            )
    return found


def corrupt_path(report: VerifyReport, name: str) -> Path:
    """The file a corrupt entry of ``report`` stands for: the ``generation`` file or ``<name>.json``."""
    filename = name if name == GENERATION_FILE else f"{name}{SUFFIX}"
    return Path(report.directory) / filename


def format_report(report: VerifyReport) -> str:
    """A human-readable summary of ``report``, one line per record, ending with the counts."""
    lines = [f"ownership records in {report.directory}:"]
    stale, no_boot_id, taken_over = set(report.stale), set(report.no_boot_id), set(report.taken_over)
    for name in report.valid:
        if name in no_boot_id:
            lines.append(
                f"  NO BOOT  {name}: no boot id; recovery keeps it aside, untouched, its instance foreign"
            )
        else:
            line = f"  stale    {name}" if name in stale else f"  valid    {name}"
            lines.append(f"{line}: taken over from HAMi" if name in taken_over else line)
    # A corrupt file is the operator's to remove, so it is named by the path to remove, not its stem.
    lines.extend(
        f"  CORRUPT  {corrupt_path(report, name)}: {why}" for name, why in sorted(report.corrupt.items())
    )
    # HAMi's files too are named by their path: the operator fixes or removes one that recovery keeps.
    lines.extend(
        f"  HAMI     {Path(report.directory) / filename}: {what}"
        for filename, what in sorted(report.hami.items())
    )
    if report.generation_ceiling is not None:
        lines.append(f"  valid    {GENERATION_FILE}: generation ceiling {report.generation_ceiling}")
    elif GENERATION_FILE not in report.corrupt:
        lines.append(f"  missing  {GENERATION_FILE}: no generation ceiling yet (a first run)")
    summary = f"{len(report.valid)} valid ({len(stale)} stale), {len(report.corrupt)} corrupt"
    if no_boot_id:
        summary += f", {len(no_boot_id)} without a boot id"
    if taken_over:
        summary += f", {len(taken_over)} taken over from HAMi"
    if report.hami:
        summary += f"; {len(report.hami)} HAMi record files left (the takeover is not complete)"
    lines.append(summary)
    return "\n".join(lines) + "\n"
