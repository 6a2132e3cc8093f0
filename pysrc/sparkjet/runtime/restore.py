"""Where a job's state comes from when it starts, and whether it fits the pipeline.

A job resumes from its own last complete snapshot, every chunk of it read and checked: a
member's start checks each chunk as its restore reads it (:func:`unchecked_start`), and
only when that fails reads the snapshots kept whole (:func:`own_start`). When it fails to
verify (a flipped byte, a missing or
truncated file, a log event that no longer reads), the job falls back to the newest older
snapshot the store keeps (``JobConfig.retained_snapshots``) that verifies, **only when no
sink has committed output past it**: a transactional sink (files, Kafka, PostgreSQL,
Delta) records in each snapshot the transactions it prepared, which phase 2 commits once
that snapshot is complete; restoring an older snapshot would write their rows again. So
when a newer snapshot holds transactions of a later snapshot than the fallback (or they
cannot be read), or an acknowledging source acknowledged what a newer snapshot covered,
:class:`~sparkjet.errors.SnapshotUnrestorableError` names the snapshots, the transactions
that would be replayed, and the ways on: restore the damaged files from a copy, or roll
back explicitly accepting the duplicates (``sparkjet snapshots rollback``). Idempotent
sinks (SQLite, PostgreSQL upserts) overwrite what a replay writes again, and under
at-least-once duplicates are allowed, so neither stands in the way. A fallback is recorded
in the log (a rollback event: the newer snapshots no longer count) and reported loudly: a
warning, a ``fallback`` progress event, and ``JobResult.fallbacks``.

A job that has none starts from
``JobConfig.initial_snapshot`` when it is set (Jet's ``setInitialSnapshotName``): an exported
snapshot of this job (``"v1"``) or of another job in the same snapshot store
(``"other-job/v1"``: the other job's name, a slash, the export's name). Its sources resume
from the export's offsets; its sinks start clean (the old job's transactions are neither
committed nor aborted: they are the old job's).

Before any execution, :func:`plan_restore` compares the pipeline that took the snapshot (the
DAG fingerprint it recorded, :func:`~sparkjet.runtime.snapshotting.read_fingerprint`) with
this one, vertex by vertex (vertices are matched by name, :mod:`sparkjet.pipeline.dag`) and
state schema by schema, and returns which old state each vertex restores. A new vertex
starts empty; a vertex of the snapshot that the pipeline lacks is refused unless
``JobConfig.state_mapping`` drops it (``{"old": None}``) or maps it to a vertex of another
name (``{"old": "new"}``: the mapping applies only to a snapshot that another pipeline took,
so one left in the configuration does nothing once the job has snapshots of its own); a
declared state schema (``map_state``) may gain nullable columns (old rows get nulls), but a
changed type or a removed column is refused, as is any change of kind, key, aggregation,
window or a source's partition count. The error lists every difference at once.
"""
from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass

import pyarrow as pa

from sparkjet.errors import (
    IncompatibleSnapshotError,
    SnapshotCorruptError,
    SnapshotIncompleteError,
    SnapshotMismatchError,
    SnapshotNotFoundError,
    SnapshotUnrestorableError,
)
from sparkjet.operators.state_store import STATE_PREFIX
from sparkjet.pipeline.dag import SOURCE, Dag, Vertex
from sparkjet.runtime.config import JobConfig, open_store
from sparkjet.runtime.lifecycle import job_name_of
from sparkjet.snapshot import layout

_log = logging.getLogger("sparkjet.job")

#: Fingerprint fields whose change makes a vertex's old state meaningless.
_STATE_FIELDS = ("kind", "keys", "aggregations", "window", "source", "on")


@dataclass(frozen=True)
class StartPoint:
    """A snapshot a job starts from: its own last complete one (``export`` None), or an
    export of ``job_name``'s (``job_id``: whose directory of the store holds it)."""

    job_id: int
    job_name: str
    snapshot_id: int
    export: str | None = None
    initial: bool = False       # from JobConfig.initial_snapshot: sinks are not recovered

    def __str__(self) -> str:
        if self.export is None:
            return f"snapshot {self.snapshot_id} of job {self.job_name!r}"
        return f"export {self.export!r} of job {self.job_name!r} (snapshot {self.snapshot_id})"


def split_initial(text: str) -> tuple[str | None, str]:
    """``"v1"`` -> (None, "v1"); ``"other-job/v1"`` -> ("other-job", "v1")."""
    job, _, export = text.rpartition("/")
    return (job or None), export


def initial_point(config) -> StartPoint:
    """The snapshot ``config.initial_snapshot`` names; SnapshotNotFoundError, naming the
    job, when there is no such export."""
    job_name, export = split_initial(config.initial_snapshot)
    if job_name is None or job_name == config.name:
        job_name, job_id = config.name, config.id
    else:
        job_id = _job_id_of(config.snapshot_store, job_name,
                            JobConfig(name=job_name, processing_guarantee="none").id)
    try:
        store = open_store(config, job_id=job_id, job_name=job_name, create=False)
    except SnapshotNotFoundError:
        raise SnapshotNotFoundError(
            f"job {config.name!r}: initial_snapshot {config.initial_snapshot!r}: job "
            f"{job_name!r} has no snapshots in {config.snapshot_store}") from None
    with store:
        info = next((s for s in store.snapshots() if s.name == export), None)
        if info is None:
            have = sorted(s.name for s in store.snapshots() if s.name)
            raise SnapshotNotFoundError(
                f"job {config.name!r}: initial_snapshot {config.initial_snapshot!r}: job "
                f"{job_name!r} has no exported snapshot {export!r} (its exports: "
                f"{have or 'none'})")
    return StartPoint(job_id, job_name, info.snapshot_id, export, initial=True)


def _job_id_of(root: str, name: str, derived: int) -> int:
    """The id of the job called ``name`` in a local store: the one its name derives, or,
    for a job given an explicit ``job_id``, the one whose JOB.json records the name."""
    from pathlib import Path


    if "://" in str(root) or (Path(root) / layout.job_dir(derived)).is_dir():
        return derived
    for d in sorted(Path(root).glob("job-" + "[0-9a-f]" * 16)):
        if job_name_of(d) == name:
            return int(d.name[4:], 16)
    return derived


@dataclass(frozen=True)
class Fallback:
    """A start from an older snapshot than the newest: ``to`` (its id), ``unusable`` (the
    newer snapshots and log events that failed, and why), ``replaced`` (the snapshot ids
    set aside), ``explicit`` (asked for by ``JobConfig.initial_snapshot``, not forced by a
    failed verification)."""

    to: int
    unusable: tuple[str, ...]
    replaced: tuple[int, ...] = ()
    explicit: bool = False

    def as_dict(self) -> dict:
        return {"to": self.to, "unusable": list(self.unusable), "replaced": list(self.replaced),
                "explicit": self.explicit}

    def message(self, job: str) -> str:
        if self.explicit:
            return (f"job {job!r} rolls back to its snapshot {self.to} (JobConfig."
                    f"initial_snapshot); snapshots {list(self.replaced)} are set aside")
        return (f"job {job!r} falls back to snapshot {self.to}: the newer ones failed to "
                f"verify: " + "; ".join(self.unusable))


def own_start(config, store, dag, execution_id: int | None = None
              ) -> tuple[int | None, Fallback | None]:
    """The job's own snapshot to start from (None: it has none) and the fallback that
    takes it there, if any (see the module doc). With ``execution_id`` (the execution
    that restores, registered in ``store``), a fallback or an explicit rollback is recorded
    in the log; without, it is only decided (to fail before any execution starts)."""
    explicit = config.initial_snapshot
    if isinstance(explicit, int) and explicit not in store.rollbacks():
        return explicit, _roll_back(config, store, explicit, execution_id)
    info, unusable = store.newest_verified()
    if not unusable:
        return (None if info is None else info.snapshot_id), None
    failed = [str(u) for u in unusable]
    name = store.who
    if info is None:
        raise SnapshotUnrestorableError(
            f"{name}: no complete snapshot it keeps verifies:\n  " + "\n  ".join(failed) +
            "\nRestore the damaged files from a copy, or start the job afresh under a new "
            "name (or in a new snapshot store)", failed, [], None)
    replayed = replay_hazards(config, dag, store, info.snapshot_id, unusable)
    if replayed:
        newest = next((u.snapshot for u in unusable if u.snapshot is not None), None)
        raise SnapshotUnrestorableError(
            f"{name}: its newest snapshot{'' if newest is None else f' {newest}'} failed to "
            f"verify, and falling back to snapshot {info.snapshot_id} would replay output "
            f"already committed past it:\n  " + "\n  ".join(replayed) +
            "\nWhat failed:\n  " + "\n  ".join(failed) +
            f"\nTo go on: restore the damaged files from a copy and run again; or roll back "
            f"accepting that this output is written again (duplicates): `sparkjet snapshots "
            f"rollback {config.snapshot_store} --job {config.name} --to {info.snapshot_id}`",
            failed, replayed, info.snapshot_id)
    fallback = Fallback(info.snapshot_id, tuple(failed))
    if execution_id is not None:
        replaced = store.rollback(info.snapshot_id, execution_id=execution_id,
                                  reason="fell back: " + "; ".join(failed)[:2000])
        fallback = Fallback(info.snapshot_id, tuple(failed), tuple(replaced))
    return info.snapshot_id, fallback


def unchecked_start(config, store) -> int | None:
    """The snapshot a start may restore before it is verified (None: :func:`own_start`
    decides): the newest complete one by the log (:meth:`SnapshotStore.newest_commit`),
    unless ``initial_snapshot`` names one of the job's own to roll back to. The restore
    checks every chunk it reads as a verification does; when one fails, the start forgets
    what it read and goes through :func:`own_start`, which verifies and falls back. The
    state is read once instead of twice (at 50M keys that was 1.5 s of a recovery)."""
    explicit = config.initial_snapshot
    if isinstance(explicit, int) and explicit not in store.rollbacks():
        return None
    return store.newest_commit()


def _roll_back(config, store, snapshot_id: int, execution_id: int | None) -> Fallback:
    """``JobConfig.initial_snapshot`` as a snapshot id of the job's own: verified, and
    with ``execution_id`` recorded as a rollback."""
    keeps = [s.snapshot_id for s in store.complete()]
    if snapshot_id not in keeps:
        raise SnapshotNotFoundError(
            f"job {config.name!r}: initial_snapshot {snapshot_id} is not a complete snapshot "
            f"of the job's that its store keeps (it keeps {keeps or 'none'})")
    if execution_id is None:
        store.verify(snapshot_id)
        return Fallback(snapshot_id, (), tuple(i for i in keeps if i > snapshot_id), True)
    replaced = store.rollback(snapshot_id, execution_id=execution_id,
                              reason="JobConfig.initial_snapshot")
    return Fallback(snapshot_id, (), tuple(replaced), True)


def report_fallback(config, fallback, progress, execution_id: int) -> dict:
    """A start from an older snapshot than the newest, said loudly: a warning and a
    ``fallback`` progress event; returns it as plain data (for ``JobResult.fallbacks``)."""
    _log.warning("%s", fallback.message(config.name),
                 extra={"job": config.name, "execution": execution_id, "member": "-"})
    progress({"event": "fallback", "execution": execution_id, **fallback.as_dict(),
              "message": fallback.message(config.name)})
    return fallback.as_dict()


def replay_hazards(config, dag, store, fallback: int, unusable) -> list[str]:
    """What a restore from snapshot ``fallback`` would replay that is already committed
    past it, one line each: the transactions of later snapshots that the unusable newer
    snapshots list for a transactional sink (committed when those completed), what could
    not be read of them, and the acknowledgements of acknowledging sources."""
    if config.processing_guarantee != "exactly-once":
        return []   # at-least-once allows duplicates
    sinks = [n for n, s in dag.sinks.items() if getattr(s.sink, "transactional", False)]
    acking = [v.name for v in dag.sources if getattr(v.source, "acknowledging", False)]
    if not sinks and not acking:
        return []
    out = []
    for u in unusable:
        if u.snapshot is None:
            out.append(f"{u}: if it was, the sinks {sinks} committed its transactions"
                       + (f" and the sources {acking} acknowledged what it covers"
                          if acking else ""))
            continue
        for name in sinks:
            try:
                entries = store.restore(name, [], snapshot_id=u.snapshot).broadcast_entries
                described = [] if entries is None else \
                    [json.loads(v) for v in entries[1].to_pylist()]
            except (SnapshotCorruptError, SnapshotIncompleteError, SnapshotNotFoundError,
                    ValueError) as e:
                out.append(f"sink {name!r}: the transactions it prepared in snapshot "
                           f"{u.snapshot} do not read ({type(e).__name__}: {e}); they were "
                           f"committed when snapshot {u.snapshot} completed")
                continue
            txns = [t for d in described if isinstance(d, dict)
                    for t in d.get("transactions") or [] if isinstance(t, dict)
                    and t.get("snapshot", fallback + 1) > fallback]
            if txns:
                rows = sum(t.get("rows", 0) for t in txns if isinstance(t.get("rows"), int))
                out.append(f"sink {name!r}: {len(txns)} transaction(s) of snapshot(s) "
                           f"{sorted({t.get('snapshot') for t in txns})} ({rows} rows), "
                           f"committed when snapshot {u.snapshot} completed")
        for name in acking:
            out.append(f"source {name!r} acknowledged the messages snapshot {u.snapshot} "
                       f"covers: a replay from snapshot {fallback} would not read them again")
    return out


def start_point(config, store, dag=None) -> StartPoint | None:
    """Where ``config``'s job starts: its own snapshot in ``store`` (the newest that
    verifies, see :func:`own_start`; with ``dag`` None, the last complete one), else its
    initial snapshot, else nowhere (None)."""
    if dag is not None:
        snapshot_id, _ = own_start(config, store, dag)
    else:
        latest = store.latest_complete()
        snapshot_id = None if latest is None else latest.snapshot_id
    if snapshot_id is not None:
        return StartPoint(config.id, config.name, snapshot_id)
    if isinstance(config.initial_snapshot, str):
        return initial_point(config)
    return None


def handed_start(config, store, restore_from: int | None):
    """With the members' storage, what the driver hands its members at join to start from
    (they never open the store): the point (its own snapshot ``restore_from``, else the
    job's initial snapshot, else None: nothing to restore), the store it is read from
    (``store``, or the other job's, which the driver keeps open while the execution runs:
    the members read the files there through it), and the join answer's ``start``: the
    point and its committed record (base64), folder and file name."""
    if restore_from is not None:
        point = StartPoint(config.id, config.name, restore_from)
    elif isinstance(config.initial_snapshot, str):
        point = initial_point(config)
    else:
        return None, None, None
    source = open_point(config, point, store)
    try:
        at = None if point.export else point.snapshot_id
        data, directory, file = source.committed_record(at, name=point.export)
        # (durable_tier="async": whether its uploads are complete, which the record cannot say)
        durable = source.durable_complete(at, name=point.export)
    except BaseException:
        if source is not store:
            source.close()
        raise
    return point, source, {"job": point.job_id, "job_name": point.job_name,
                           "snapshot": point.snapshot_id, "export": point.export,
                           "initial": point.initial, "dir": list(directory), "file": file,
                           "record": base64.b64encode(data).decode(), "durable": durable}


def handed_point(start: dict) -> StartPoint:
    """The :class:`StartPoint` of a join answer's ``start`` (see :func:`handed_start`)."""
    return StartPoint(int(start["job"]), str(start["job_name"]), int(start["snapshot"]),
                      start.get("export"), bool(start.get("initial")))


def open_point(config, point: StartPoint, own):
    """The store to read ``point`` from: ``own`` (the job's store) or the other job's."""
    if point.job_id == config.id:
        return own

    return open_store(config, job_id=point.job_id, job_name=point.job_name, create=False)


@dataclass
class RestorePlan:
    """Which old state each vertex and sink of the new pipeline restores (None: none),
    whether the pipeline is the one that took the snapshot (``same``: then the outputs'
    recorded schemas hold), and what differs but restores (``notes``)."""

    vertices: dict[str, str | None]
    sinks: dict[str, str | None]
    same: bool
    notes: list[str]


def plan_restore(dag: Dag, saved: dict | None, point: StartPoint,
                 mapping: dict[str, str | None] | None) -> RestorePlan:
    """Checks that the state of ``point`` (whose pipeline's fingerprint is ``saved``) fits
    ``dag``; returns the :class:`RestorePlan`, or raises
    :class:`~sparkjet.errors.IncompatibleSnapshotError` listing every difference."""
    mapping = dict(mapping or {})
    if saved is None:
        if dag.legacy_shape():
            return RestorePlan({n: n for n in dag.vertices}, {} if point.initial else
                               {n: n for n in dag.sinks}, True, [])
        raise SnapshotMismatchError(
            f"{point} was taken by a sparkjet before DAG pipelines, of a one-source pipeline "
            f"with at most one group_by; this pipeline has vertices {list(dag.vertices)} and "
            f"sinks {list(dag.sinks)}. Run it under a new job name, or restore with the "
            f"pipeline that took the snapshot")
    mine = dag.fingerprint()
    old_v = {v["name"]: v for v in saved.get("vertices", [])}
    new_v = {v["name"]: v for v in mine["vertices"]}
    old_s = {s["name"]: s for s in saved.get("sinks", [])}
    new_s = {s["name"]: s for s in mine["sinks"]}
    if saved == mine:
        # The snapshot is this pipeline's own: its state belongs as it is, and a mapping
        # left in the configuration after an upgrade never drops it again.
        return RestorePlan({n: n for n in new_v}, {} if point.initial else
                           {n: n for n in new_s}, True, [])
    errors: list[str] = []
    notes: list[str] = []
    for old, new in mapping.items():
        if old not in old_v and old not in old_s:
            errors.append(f"state_mapping names {old!r}, which {point} does not have (it has "
                          f"vertices {sorted(old_v)} and sinks {sorted(old_s)})")
        elif new is not None and new not in (new_v if old in old_v else new_s):
            errors.append(f"state_mapping maps {old!r} to {new!r}, which this pipeline does "
                          f"not have (it has {sorted(new_v if old in old_v else new_s)})")
    taken: dict[str, str] = {}
    for old, new in mapping.items():
        if new is not None:
            if new in taken:
                errors.append(f"state_mapping maps both {taken[new]!r} and {old!r} to {new!r}")
            taken[new] = old

    def source_of(new: str, olds: dict) -> str | None:
        if new in taken:
            return taken[new]
        return new if new in olds and new not in mapping else None

    vertices: dict[str, str | None] = {}
    for name, v in dag.vertices.items():
        old = source_of(name, old_v)
        vertices[name] = old
        if old is None:
            notes.append(f"vertex {name!r} ({v.kind}) is new: it starts empty")
            continue
        errors += _vertex_differences(name, old_v[old], new_v[name], v, notes)
    sinks: dict[str, str | None] = {}
    if not point.initial:   # a new job's sinks never take over the old job's transactions
        for name in dag.sinks:
            old = source_of(name, old_s)
            sinks[name] = old
            if old is not None and old_s[old]["sink"] != new_s[name]["sink"]:
                errors.append(f"sink {name!r} was {old_s[old]['sink']}, is now "
                              f"{new_s[name]['sink']}: its prepared transactions would go to "
                              f"a sink of another kind")
    restored = set(vertices.values()) | set(sinks.values())
    for name, v in old_v.items():
        if name not in restored and name not in mapping:
            errors.append(f"the snapshot has a vertex {name!r} ({v['kind']}) this pipeline "
                          f"lacks: its state would be lost (drop it with state_mapping="
                          f"{{{name!r}: None}}, or map it to a vertex of this pipeline)")
    if not point.initial:
        for name, s in old_s.items():
            if name not in restored and name not in mapping:
                errors.append(f"the snapshot has a sink {name!r} ({s['sink']}) this pipeline "
                              f"lacks: its prepared transactions would be left undecided "
                              f"(drop it with state_mapping={{{name!r}: None}})")
    if errors:
        raise IncompatibleSnapshotError(
            f"{point} does not fit this pipeline; it was taken by a pipeline of another "
            f"shape:\n  " + "\n  ".join(errors) + "\nRestore with the pipeline that took it, "
            "give JobConfig.state_mapping, or run this pipeline under a new job name",
            errors)
    return RestorePlan(vertices, sinks, False, notes)


def _vertex_differences(name: str, old: dict, new: dict, v: Vertex, notes: list) -> list[str]:
    where = f"vertex {name!r}" + (f" (from the snapshot's {old['name']!r})"
                                  if old["name"] != name else "")
    if old["kind"] != new["kind"]:
        return [f"{where} was kind={old['kind']}, is now kind={new['kind']}"]
    errors = []
    for field in _STATE_FIELDS[1:]:
        if field == "aggregations" and field in old and field in new:
            errors += _aggregation_differences(where, old["name"], old[field], new[field])
        elif old.get(field) != new.get(field):
            errors.append(f"{where} was {field}={old.get(field)}, is now {field}={new.get(field)}")
    if v.kind == SOURCE and old.get("partitions") != new.get("partitions"):
        # offsets are per partition, and a source's reader expects its own partitions'
        errors.append(f"{where} was partitions={old['partitions']}, is now "
                      f"partitions={new['partitions']}: its offsets are per partition (drop "
                      f"them with state_mapping={{{old['name']!r}: None}} to read from the start)")
    if "state" in old or "state" in new:
        errors += _state_differences(where, old.get("state", []), v, notes)
    for field in sorted((set(old) | set(new)) - {*_STATE_FIELDS, "name", "state", "partitions"}):
        if old.get(field) != new.get(field):   # policy (a ttl, a function): no state's shape
            notes.append(f"{where}: {field} was {old.get(field)}, is now {new.get(field)}")
    return errors


def _aggregation_differences(where: str, old_name: str, old: dict, new: dict) -> list[str]:
    out = []
    for a in sorted(set(old) | set(new)):
        if a not in new:
            out.append(f"{where}: aggregation {a!r} ({old[a]}) was removed")
        elif a not in old:
            out.append(f"{where}: aggregation {a!r} ({new[a]}) was added; the old keys have no "
                       f"value for it (an aggregate is not nullable: start the vertex empty "
                       f"with state_mapping={{{old_name!r}: None}})")
        elif old[a] != new[a]:
            out.append(f"{where}: aggregation {a!r} changed from {old[a]} to {new[a]}")
    return out


def _state_differences(where: str, old: list[str], v: Vertex, notes: list) -> list[str]:
    """A map_state's declared state: old columns (``"name: type"`` strings) against the
    new schema; added nullable columns restore as nulls."""
    schema = getattr(v.stage, "state", None)
    if not isinstance(schema, pa.Schema):
        return [f"{where} had the declared state ({', '.join(old)}), and has none now"]
    before = dict(s.split(": ", 1) for s in old)
    out = []
    for c, t in before.items():
        if c not in schema.names:
            out.append(f"{where}: state column {c!r} ({t}) was removed")
        elif str(schema.field(c).type) != t:
            out.append(f"{where}: state column {c!r} changed type {t} -> {schema.field(c).type}")
    for f in schema:
        if f.name in before:
            continue
        if f.nullable:
            notes.append(f"{where}: state column {f.name!r} ({f.type}) is new: the old keys' "
                         f"state has nulls in it")
        else:
            out.append(f"{where}: state column {f.name!r} ({f.type}) was added, not nullable; "
                       f"the old keys have no value for it (make it nullable)")
    return out


def conform_state(vertex: Vertex, table: pa.Table | None) -> pa.Table | None:
    """An old snapshot's state table for ``vertex``: a map_state whose declared state
    gained nullable columns gets them as nulls (checked by :func:`plan_restore`)."""
    schema = getattr(vertex.stage, "state", None)
    if table is None or not isinstance(schema, pa.Schema):
        return table

    for f in schema:
        name = STATE_PREFIX + f.name
        if name not in table.column_names:
            table = table.append_column(pa.field(name, f.type), pa.nulls(table.num_rows, f.type))
    return table


def log_plan(config, point: StartPoint, plan: RestorePlan) -> None:
    if not plan.same:
        _log.info("job %r restores %s into a changed pipeline: %s", config.name, point,
                  "; ".join(plan.notes) or "the state fits",
                  extra={"job": config.name, "execution": "-", "member": "-"})


__all__ = ["Fallback", "RestorePlan", "StartPoint", "conform_state", "handed_point",
           "handed_start", "initial_point", "open_point", "own_start", "plan_restore",
           "replay_hazards", "report_fallback", "split_initial", "start_point", "unchecked_start"]
