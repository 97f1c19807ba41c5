"""Startup recovery (``docs/architecture.md``, "Recoverer"): gather -> plan (pure) -> apply.

Recoverer decides about hardware it did not just create, after a crash, with nothing but durable
records, pod annotations and what NVML shows. The decision is one pure function over plain values
(``plan.plan``), so every rule is testable on plain data and *nothing* is modified unless the whole
picture was read and verified. The modules, and the shell that runs them:

- ``inputs``: what gather reads (``Inputs``); ``steps``: what plan decides (``Plan``, ``Step``,
  the ``Action``s, ``RecoveryReport``, ``settle_report``); ``draft``: the plan being drafted, which the rules
  pass along; ``active``, ``recorded``, ``corrupt``, ``unowned``, ``specs``: rules 1-5;
  ``plan``: runs them in order. All of these are pure (a test imports them in a fresh interpreter).
- ``sidecar.lifecycle.recover``: the imperative shell, ``Recoverer``: gather (reads everything, modifies
  nothing), apply (records first; a failing step puts its instance in ERROR, or leaves it foreign when it
  turns out not to be ours), then ``LifecycleContext.install``.

This package imports nothing on its own: ``from sidecar.lifecycle.recover import Recoverer``.

The rules in full (the overview: ``docs/architecture.md``, "Recoverer"):

1. Each active allocation must match a live GI/CI exactly: GPU, profile (name -> the GI's profile ID),
   placement, GI ID, CI ID, MIG UUID, and a single full-size CI. The record becomes ``ACTIVE`` with the
   allocation as owner. Any mismatch, two allocations naming one instance, or one key naming two
   reservations -> ``UnverifiableState``. An allocation without runtime identity is a pending
   reservation (``sidecar.model.pending``): nothing to verify, never a failure; the plan hands it to the
   lifecycle, where it keeps the IDLE or ERROR instance at exactly its spot from being destroyed.
   In a Recover repeated once the sidecar has recovered, the table is newer than the pod list: an
   instance ACTIVE for another key now (released and reused since the list was taken) stays with
   that key, a key that holds another
   instance now is not given a second one, an instance IDLE now stays IDLE (released since the
   list was taken, as far as a Recover without a generation can tell; SyncActive, which is fenced,
   reactivates it for a pod that still holds it), and an instance ERROR now (its destroy failed)
   stays ERROR, never reused, unless its record's owner is the listed allocation (recovery's own
   adoption of that pod, whose record could not be written); each is reported in ``errors``, and the
   MIG UUIDs so refused do not guard ERROR instances from the reconciler.
2. A valid record is matched against the live GI at *exactly* its placement. ``IDLE``/``ACTIVE`` records
   whose GI and CI verify are restored ``IDLE`` - except ``ACTIVE`` ones in a Recover repeated once
   the sidecar has recovered: those stay ``ACTIVE``. One that goes IDLE here (or is adopted IDLE by
   rule 4) is stamped with the recovery's fresh generation, as a release stamps its own (SyncActive's
   reactivation fence). A repeated Recover has no generation fence, and
   its pod list may predate an Allocate or a Release since; releasing and reactivating are
   SyncActive's job, which is fenced. A repeated Recover still adopts the other listed
   allocations, restores, finishes and repairs all the rest.
   ``CREATING`` records are undone and ``DELETING`` ones finished, destroying only what verifies as
   theirs. ``ERROR`` records stay ``ERROR``, except one without a GI ID (a create made the GI, then
   it and its undo failed to read it): its bare GI is destroyed as for ``CREATING``. Only a record
   whose create issued the CI create (``CREATING``, or ``ERROR`` after a failed undo:
   ``may_own_unrecorded_ci``) may own a CI it never recorded (the create stopped between making the
   CI and recording it); any other record without a CI ID stands for a bare GI, and a CI in that GI
   is someone else's (the rule ``Lifecycle``'s destroy applies too).
   A record without a boot ID (every writer stamps one: it was made or edited by hand) is kept
   aside whatever its state: on disk untouched with its CDI file, out of the table, the GI at its
   placement foreign, reported in ``errors``; nothing is destroyed or dropped on its word (an active
   allocation that verifies against the live instance there still adopts it, by rule 1).
   A record of this boot on a GPU NVML does not list is kept on disk untouched with its CDI file,
   out of the table, and reported in ``errors``: the GPU may only be hidden and come back, and
   nothing verifies its instance is gone (one of an earlier boot there is dropped as stale). A
   record whose GI is gone (including after a reboot) is dropped with its CDI file. A record from
   an earlier boot (a non-empty boot ID that is not this one) is stale unless a live CI in the GI at
   its placement has exactly its MIG UUID: GI IDs are reused and placements repeat, so placement,
   profile and GI ID prove nothing across a reboot. A stale record is dropped with its CDI file and
   claims nothing: the GI there is left to rule 4 (foreign, or adopted). A record that contradicts
   the live GI at its placement is kept on disk for the operator and that GI is foreign - unless it
   comes from an earlier boot, in which case it is dropped as stale.
3. A corrupt record file is never touched; live GIs overlapping the placement in its file name are
   foreign (never reused, never adopted, never destroyed).
4. Live GIs nobody claims are foreign and preserved. With ``adopt_existing``: a GI with exactly one
   full-size CI gets an ``IDLE`` record; a GI without a CI is destroyed only on a GPU with no active
   allocation, no instance that stays ``ACTIVE`` and no running process.
5. CDI: every live owned ``ACTIVE``/``IDLE`` instance gets its spec ensured (rewritten if missing or
   different) in the step that records it, after its record, so an instance whose record could not
   be written is not published; spec files of this sidecar's kind whose MIG UUID is no live owned
   instance are removed (the file found by content, whatever its name), except those of instances
   preserved because of a kept or corrupt record (the operator may restore the record).
"""
