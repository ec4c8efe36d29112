"""The code sandbox under attack: each test runs hostile code and checks that it fails safely. Every
isolation mode that works on this machine is tested: "root" (privileged bubblewrap, uid dropped to nobody)
when the tests run as root, and "userns" (an unprivileged user namespace, the path a
normal user takes); the last test repeats the escapes as the unprivileged user `nobody` where it can."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from posttrain.environments import sandbox
from posttrain.environments.sandbox import SandboxLimits, SandboxUnavailableError, run_python


def available_modes() -> list[str]:
    modes = []
    for mode in ["root", "userns"] if os.geteuid() == 0 else ["userns"]:
        try:
            result = run_python("print('ok')", mode=mode) if sandbox.bwrap_path() else None
        except OSError:
            result = None
        if result is not None and result.stdout == "ok\n":
            modes.append(mode)
    return modes


MODES = available_modes()
mode_param = pytest.mark.parametrize(
    "mode", MODES or [pytest.param("none", marks=pytest.mark.skip(reason="no bubblewrap sandbox works here"))]
)


def run(code: str, mode: str, **limits) -> sandbox.SandboxResult:
    return run_python(textwrap.dedent(code), SandboxLimits(**limits), mode=mode)


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture
def tcp_listener():
    """A 127.0.0.1 listener on the host that records whether anything connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    connected, stop = [], threading.Event()

    def accept():
        while not stop.is_set() and not connected:
            try:
                connected.append(server.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], connected
    stop.set()
    thread.join()
    server.close()


@mode_param
def test_sandbox_runs_code_as_nobody_with_a_scrubbed_environment(mode, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-1234")
    result = run("import os; print(os.getuid(), sorted(os.environ))", mode)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{sandbox.NOBODY} ['HOME', 'LANG', 'PATH', 'PWD']\n"


@mode_param
def test_setns_into_other_namespaces_then_connect_to_a_host_listener_fails(mode, tcp_listener):
    """The issue's escape: ctypes setns() into the parent's network namespace, then a subprocess that
    connects to a 127.0.0.1 listener. The sandbox sees no process of the host, and holds no capability."""
    port, connected = tcp_listener
    result = run(
        f"""
        import ctypes, os, socket, subprocess, sys
        libc = ctypes.CDLL(None, use_errno=True)
        joined = 0
        for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['{os.getppid()}', '{os.getpid()}']:
            for ns in ('net', 'user', 'mnt', 'pid'):
                try:
                    fd = os.open(f'/proc/{{pid}}/ns/{{ns}}', os.O_RDONLY)
                except OSError:
                    continue
                joined += libc.setns(fd, 0) == 0
        print('unshare', libc.unshare(0x40000000 | 0x10000000))
        code = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')"
        out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
        print(out.stdout, out.stderr.strip().splitlines()[-1:])
    """,
        mode,
    )
    time.sleep(0.5)
    assert connected == [], "the sandbox reached a listener on the host's loopback"
    assert "CONNECTED" not in result.stdout
    assert "Network is unreachable" in result.stdout or "Connection refused" in result.stdout


@mode_param
def test_unix_sockets_of_the_host_are_unreachable(mode, tmp_path):
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0posttrain-test-" + uuid.uuid4().hex.encode())
    abstract.listen()
    try:
        result = run(
            f"""
            import glob, socket
            for address in [{str(path)!r}, {abstract.getsockname()!r}] + glob.glob('/tmp/ray/**/*',
            recursive=True):
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(address); print('CONNECTED', address)
                except OSError as error:
                    print('refused', type(error).__name__)
        """,
            mode,
        )
    finally:
        server.close()
        abstract.close()
    assert result.returncode == 0, result.stderr
    assert "CONNECTED" not in result.stdout and result.stdout.count("refused") == 2


@mode_param
def test_the_parents_environment_and_processes_are_invisible(mode, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf-secret-5678")
    result = run(
        f"""
        import os
        pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        leaked = []
        for pid in set(pids) | {{os.getppid(), {os.getpid()}, {os.getppid()}}}:
            try:
                leaked.append(open(f'/proc/{{pid}}/environ', 'rb').read())
            except OSError:
                pass
        print(pids, b'hf-secret' in b''.join(leaked))
    """,
        mode,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[1, 2] False\n"  # bwrap's init and the code itself


@mode_param
def test_writes_outside_the_scratch_directory_fail(mode, tmp_path):
    target = tmp_path / "escaped.txt"
    result = run(
        f"""
        ok = []
        for path in [{str(target)!r}, '/usr/escaped', '/escaped', '/code/main.py', '/tmp/../escaped',
        '/scratch/fine']:
            try:
                open(path, 'w').write('x'); ok.append(path)
            except OSError:
                pass
        print(ok)
    """,
        mode,
    )
    assert result.stdout == "['/scratch/fine']\n", result.stderr
    assert not target.exists()


@mode_param
def test_a_fork_bomb_hits_the_process_limit_and_nothing_survives(mode):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    result = run(
        f"""
        import os, time
        children = 0
        try:
            for _ in range(200):
                if os.fork() == 0:
                    time.sleep(60); os._exit(0)
                children += 1
        except OSError as error:
            print('stopped after', children, type(error).__name__, flush=True)
        os.execv('/bin/sleep', ['{marker}', '60'])
    """,
        mode,
        timeout_s=3.0,
        max_processes=16,
    )
    assert result.timed_out
    stopped = result.stdout.split()
    assert stopped[:2] == ["stopped", "after"] and int(stopped[2]) < 16 and stopped[3] == "BlockingIOError"
    time.sleep(0.3)
    assert processes_with(marker) == []


@mode_param
@pytest.mark.parametrize("ending", ["exits", "times out"])
def test_a_setsid_grandchild_does_not_outlive_the_call(mode, ending):
    marker = f"survivor-{uuid.uuid4().hex}"
    result = run(
        f"""
        import subprocess
        subprocess.Popen(['{marker}', '60'], executable='/bin/sleep', start_new_session=True)
        print('spawned', flush=True)
        {"import time; time.sleep(60)" if ending == "times out" else ""}
    """,
        mode,
        timeout_s=6.0,  # the sandboxed interpreter must start and spawn first, on a loaded machine too
    )
    assert result.stdout == "spawned\n" and result.timed_out == (ending == "times out")
    assert "Error" not in result.stderr, result.stderr
    time.sleep(0.3)
    assert processes_with(marker) == []


@mode_param
def test_a_stdout_flood_is_cut_at_the_cap_without_buffering_it(mode):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = run(
        """
        import sys
        block = 'x' * 65536
        for _ in range(25000):  # 1.6 GB
            sys.stdout.write(block)
    """,
        mode,
        timeout_s=20.0,
        max_output_bytes=4096,
    )
    assert result.output_truncated and result.returncode is None and not result.timed_out
    assert len(result.stdout) == 4096
    assert time.monotonic() - start < 5.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50_000  # KiB


@mode_param
def test_killing_the_parent_or_every_process_only_ends_the_sandbox(mode):
    result = run(
        """
        import os, signal
        for target in (os.getppid(), -1, %d):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError as error:
                print(type(error).__name__)
        print('still here')
    """
        % os.getpid(),
        mode,
    )
    assert result.returncode == 0, result
    assert result.stdout.splitlines()[-1] == "still here"  # nothing outside was reachable to kill
    assert Path(f"/proc/{os.getpid()}").exists()


@mode_param
def test_time_memory_and_file_size_limits(mode):
    assert run("while True:\n    pass", mode, timeout_s=1.0).timed_out
    assert "MemoryError" in run("x = bytearray(2 * 1024**3)", mode, memory_mb=256).stderr
    big = run("open('/scratch/big', 'wb').write(b'x' * (8 * 1024**2))", mode, max_file_mb=4)
    assert big.returncode != 0  # SIGXFSZ / EFBIG


def test_missing_bubblewrap_refuses_to_run_code(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        run_python("print(1)")


def test_namespaces_that_cannot_be_created_refuse_to_run_code(monkeypatch, tmp_path):
    """A bwrap that fails the way it does in a container without user namespaces."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("POSTTRAIN_BWRAP", str(fake))
    with pytest.raises(SandboxUnavailableError, match="No permissions to create new namespace"):
        run_python("print(1)")


ESCAPES_AS_NOBODY = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
print(sandbox.sandbox_mode())
result = sandbox.run_python(sys.argv[2], sandbox.SandboxLimits(timeout_s=5.0, max_processes=16))
print(result.stdout.strip(), result.returncode)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the tests already run as an unprivileged user")
def test_escapes_fail_when_an_unprivileged_user_runs_the_sandbox(tcp_listener, tmp_path):
    """The user-namespace path as a normal user takes it: the system Python run as `nobody` loads
    sandbox.py (standard library only) and runs escapes: uid, processes, network, a host file, fork bomb."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} to run as nobody")
    port, connected = tcp_listener
    tmp_path.chmod(0o777)
    target = tmp_path / "escaped.txt"
    code = textwrap.dedent(f"""
        import os, socket
        print(os.getuid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))
        try:
            socket.create_connection(('127.0.0.1', {port}), timeout=2)
        except OSError:
            print('no network')
        try:
            open({str(target)!r}, 'w')
        except OSError as error:
            print('no host file:', type(error).__name__)
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print('unshare refused:', libc.unshare(0x10000000 | 0x00020000) != 0)
        children = 0
        try:
            while os.fork():
                children += 1
        except OSError:
            print('forks stopped:', children < 16)
        else:
            os._exit(0)
    """)
    # A copy of the module in a directory nobody may read: the clone itself may live in a 0700 directory.
    readable = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-module-", dir="/tmp"))
    readable.chmod(0o755)
    module = readable / "sandbox.py"
    shutil.copy(sandbox.__file__, module)
    module.chmod(0o644)
    out = subprocess.run(
        [python, "-I", "-c", ESCAPES_AS_NOBODY, str(module), code],
        user=sandbox.NOBODY,
        group=sandbox.NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )
    if out.returncode != 0 and "SandboxUnavailableError" in out.stderr:
        pytest.skip(f"no unprivileged user namespaces here: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "userns",
        f"{sandbox.NOBODY} ['1', '2']",
        "no network",
        "no host file: FileNotFoundError",
        "unshare refused: True",
        "forks stopped: True 0",
    ]
    assert connected == [] and not target.exists()


@mode_param
def test_an_interpreter_in_a_venv_under_tmp_still_runs(mode):
    """A clone (and its .venv) under /tmp: the sandbox's empty /tmp must not hide the interpreter. The
    sandbox module needs the standard library and pyseccomp (pure Python over libseccomp) only, so a
    bare venv given a copy of pyseccomp runs it straight from its file."""
    import sys

    import pyseccomp

    venv = Path("/tmp") / f"posttrain-venv-{uuid.uuid4().hex[:8]}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / "extra").mkdir()
    shutil.copy(pyseccomp.__file__, venv / "extra")  # one module file
    try:
        program = (
            "import importlib.util as u, sys; sys.path.insert(0, sys.argv[2]); "
            "spec = u.spec_from_file_location('sandbox', sys.argv[1]); "
            "box = u.module_from_spec(spec); sys.modules['sandbox'] = box; spec.loader.exec_module(box); "
            f"print(box.run_python('print(6 * 7)', mode={mode!r}).stdout, end='')"
        )
        result = subprocess.run(
            [str(venv / "bin" / "python"), "-c", program, sandbox.__file__, str(venv / "extra")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.stdout == "42\n", result.stderr
    finally:
        subprocess.run(["rm", "-rf", str(venv)], check=True)


NESTED_TMPFS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
    print('unshare:', os.strerror(ctypes.get_errno()))
else:
    uid, gid = os.getuid(), os.getgid()
    open('/proc/self/setgroups', 'w').write('deny')
    open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')
    open('/proc/self/gid_map', 'w').write(f'0 {gid} 1')
    if libc.mount(b'none', b'/tmp', b'tmpfs', 0, b'size=2g') != 0:
        print('mount:', os.strerror(ctypes.get_errno()))
written = 0
try:
    for i in range(40):
        with open(f'/tmp/fill{i}', 'wb') as f:
            f.write(b'x' * (15 * 1024 * 1024))
        written += 15
except OSError:
    pass
print('written MB:', written)
"""


@mode_param
def test_a_nested_namespace_with_its_own_tmpfs_is_refused(mode):
    """The code may neither make a user + mount namespace nor mount a tmpfs of its own, so it cannot hold
    host memory past the scratch limit: /tmp inside is bwrap's own tmpfs, read-only under --remount-ro."""
    result = run(NESTED_TMPFS, mode, timeout_s=10.0, memory_mb=512, max_file_mb=16)
    assert result.stdout.splitlines() == ["unshare: Operation not permitted", "written MB: 0"], result.stderr


@mode_param
def test_io_uring_which_a_filter_cannot_see_into_is_refused(mode):
    """io_uring_setup (syscall 425 on x86_64 and arm64) fails with EPERM: io_uring's own requests would
    bypass the filter."""
    result = run(
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "print(libc.syscall(425, 8, 0), ctypes.get_errno())",
        mode,
    )
    assert result.stdout == "-1 1\n", result.stderr


def test_the_seccomp_filter_refuses_namespaces_mounts_and_clone3():
    """Decoded from the compiled program: every refused syscall is in it, and it is not empty."""
    program = sandbox.seccomp_program()
    assert program is not None and len(program) % 8 == 0 and len(program) > 8 * len(sandbox.REFUSED_SYSCALLS)


FORKED_HOLDERS = """
import os, time
pids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = b'x' * (300 * 1024 * 1024)  # written, so every page is resident
        time.sleep(4)  # all six would hold their blocks at once
        os._exit(0)
    pids.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in pids]
print('held to the end:', sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses))
"""


def sandbox_cgroups() -> list[str]:
    found = []
    for hierarchy in (sandbox.CGROUP_ROOT, sandbox.CGROUP_ROOT / "memory", sandbox.CGROUP_ROOT / "pids"):
        if hierarchy.is_dir():
            found += [p.name for p in hierarchy.iterdir() if p.name.startswith("posttrain-sandbox-")]
    return found


@mode_param
def test_the_whole_sandbox_holds_at_most_memory_mb_however_it_forks(mode):
    """Six children of 300 MB each, all asked to hold at once under memory_mb=512 (per process they fit):
    the sandbox's cgroup lets at most one hold its block to the end (the others are killed; counted once
    all have exited, so a loaded machine that is slow to fill the blocks changes nothing), and its peak
    stays within 512 MiB (margin: none beyond the kernel's page accounting). Where no cgroup can be made
    the test is skipped, saying so."""
    if sandbox.create_cgroup(SandboxLimits(), owner=None) is None:
        pytest.skip("no cgroup can be made here: only per-process limits hold (see sandbox.py)")
    sandbox_cgroups_before = sandbox_cgroups()
    for leftover in sandbox_cgroups_before:  # the probe's own group
        for hierarchy in (sandbox.CGROUP_ROOT / "memory", sandbox.CGROUP_ROOT / "pids", sandbox.CGROUP_ROOT):
            if (hierarchy / leftover).is_dir():
                (hierarchy / leftover).rmdir()
    result = run(FORKED_HOLDERS, mode, timeout_s=15.0, memory_mb=512, max_processes=16)
    assert result.stdout in ("held to the end: 0\n", "held to the end: 1\n"), (result.stdout, result.stderr)
    assert result.memory_exceeded
    assert result.memory_peak_bytes is not None and result.memory_peak_bytes <= 512 * 1024 * 1024
    assert sandbox_cgroups() == []  # each run removes its group


def test_without_a_cgroup_the_sandbox_still_runs_with_per_process_limits(monkeypatch, tmp_path, caplog):
    """A machine with neither cgroup v2 delegation nor v1 hierarchies: the run goes on, and says which
    limits hold."""
    if not MODES:
        pytest.skip("no bubblewrap sandbox works here")
    monkeypatch.setattr(sandbox, "CGROUP_ROOT", tmp_path)
    sandbox._warn_no_cgroup.cache_clear()
    with caplog.at_level("WARNING"):
        result = run("print(6 * 7)", MODES[0])
    assert result.stdout == "42\n" and result.memory_peak_bytes is None
    assert "limited per process only" in caplog.text
