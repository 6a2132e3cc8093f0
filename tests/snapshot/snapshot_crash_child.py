"""A snapshot writer that kills itself (SIGKILL, as kill -9) at one chosen I/O call.

`python snapshot_crash_child.py ROOT SNAPSHOT EXECUTION PHASE:INDEX MODE`. Every os.write /
os.writev / os.fsync / os.link / os.rename / os.replace counts as one call of the phase it
happens in (register event, chunk files, finish, validation record, commit event, cleanup);
at call INDEX of PHASE the process dies before the call (MODE "before") or after writing
half of a write's bytes (MODE "mid"). A chunk file's chunks are written one writev call
each here (a writer gathers ~2 MB a call), so that a kill can fall between any two.
PHASE:INDEX "none" runs to the end and prints the number of calls made in each phase, as
JSON.

`python snapshot_crash_child.py --serve` (what tests/snapshot/test_snapshot_crash.py runs):
reads one JSON list of those five arguments a line, forks a writer process for each (this
process has done the imports, and starts no thread, so a fork costs what the writing costs,
not a new interpreter's imports) and answers one JSON line: the writer's return code
(-9: killed) and what it printed on stdout and stderr.
"""
import json
import os
import signal
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from helpers.snapshot_data import entries, state  # noqa: E402

from sparkjet.snapshot import store as snapshot_store  # noqa: E402
from sparkjet.snapshot import writer as snapshot_writer  # noqa: E402

snapshot_writer._WRITE_BYTES = 1

root, kill_phase, kill_index, mode = "", "none", -1, "before"
phase = "start"
lock = threading.Lock()  # the store writes files from several threads
counts: dict[str, int] = {}
real = {name: getattr(os, name)
        for name in ("write", "writev", "fsync", "link", "rename", "replace")}


def die():
    fd = os.open(os.path.join(root, "..", "killed-in"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    real["write"](fd, f"{phase} {mode}".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def counted(name):
    def call(*args, **kwargs):
        with lock:
            if phase == kill_phase and counts.get(phase, 0) == kill_index:
                if name == "write" and mode == "mid" and len(args[1]) > 1:
                    real["write"](args[0], memoryview(args[1])[: len(args[1]) // 2])
                if name == "writev" and mode == "mid":
                    # the first half of the bytes of the buffers, then the kill
                    views = [memoryview(b).cast("B") for b in args[1]]
                    left, half = sum(v.nbytes for v in views) // 2, []
                    for v in views:
                        half.append(v[:left])
                        left -= half[-1].nbytes
                    real["writev"](args[0], half)
                die()
            counts[phase] = counts.get(phase, 0) + 1
        return real[name](*args, **kwargs)
    return call


for name in real:
    setattr(os, name, counted(name))


def in_phase(label, fn):
    def wrapped(*args, **kwargs):
        global phase
        outer, phase = phase, label
        try:
            return fn(*args, **kwargs)
        finally:
            phase = outer
    return wrapped


Store, Writer = snapshot_store.SnapshotStore, snapshot_store.SnapshotWriter
write = Writer._write


def write_and_drain(self, *args, **kwargs):
    # the writer's I/O thread writes the file: wait for it, so that its calls count here
    write(self, *args, **kwargs)
    self._drain()


Writer._write = in_phase("chunk files", write_and_drain)
Writer.finish = in_phase("finish", Writer.finish)
Store.commit = in_phase("validation record", Store.commit)
append = Store._append
Store._append = lambda self, event, check=None: in_phase(
    f"{event.__struct_config__.tag} event", append)(
    self, event, check)
Store._cleanup = in_phase("cleanup", Store._cleanup)



def write_snapshot(root_, snapshot_id, execution_id, kill_at, mode_):
    """Writes snapshot ``snapshot_id`` of execution ``execution_id`` under ``root_``, dying
    at ``kill_at`` (PHASE:INDEX or "none"); prints the calls made in each phase."""
    global root, kill_phase, kill_index, mode, phase
    root, mode, phase = root_, mode_, "start"
    kill_phase, _, index = kill_at.partition(":")
    kill_index = int(index or -1)
    counts.clear()
    snapshot_id, execution_id = int(snapshot_id), int(execution_id)
    store = Store(root, job_id=9)
    store.register_execution(execution_id)
    w = store.writer(snapshot_id, execution_id, chunk_size=8192)
    w.write_table("agg", state(snapshot_id), key="key")
    w.write_entries("py", *entries(snapshot_id))
    w.write_broadcast_table("agg", state(snapshot_id, 5))
    w.commit()
    store.close()
    print(json.dumps(counts))


def serve():
    """One forked writer per line of stdin; one JSON line of its outcome on stdout each."""
    for line in sys.stdin:
        args = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    write_snapshot(*args)
                    code = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            answer = {"returncode": os.waitstatus_to_exitcode(status)}
            for name, f in (("stdout", out), ("stderr", err)):
                f.seek(0)
                answer[name] = f.read().decode(errors="replace")
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        write_snapshot(*sys.argv[1:6])
