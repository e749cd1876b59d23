"""g++ builds one shared library per (source, options, kernels, mode), cached on disk under a hash of all of
them (and of the runtime header and the compiler's version), written atomically."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("fast", "memcheck", "race", "profile")

_MODE_FLAGS = {
    # -O1: a kernel builds about a third sooner than at -O2 and runs about a sixth slower; a cold test suite builds
    # some three hundred kernels and runs each on a few small problems, so the builds are what it waits for.
    "fast": ["-O1"],
    # The sanitizers' builds are what a cold suite waits for longest, and their kernels run on a few small
    # problems: -g1 (line tables, no variables) keeps every report's file and line at a fraction of -g's build
    # time. Memcheck builds at -O0 (half the time again; every access where the source has it); race mode stays
    # at -O1, where TSan's reports from inside a cp.async window come out whole. Frame pointers give the
    # sanitizers' fast unwinders whole stacks.
    "memcheck": ["-O0", "-g1", "-fsanitize=address", "-fno-omit-frame-pointer", "-DCUFLASH_SIMT_MEMCHECK"],
    "race": ["-O1", "-g1", "-fsanitize=thread", "-fno-omit-frame-pointer", "-DCUFLASH_SIMT_RACE"],
    # ThreadSanitizer's instrumentation without its runtime: every load and store calls a hook that
    # runtime/profile.h defines. -O1 vectorizes nothing, so each access keeps the width the source gives it;
    # -g maps the hooks' return addresses to source lines.
    "profile": ["-O1", "-g", "-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0",
                "-DCUFLASH_SIMT_PROFILE"],
}
# Linked after the source. The profile build leaves out g++'s default libraries, which with -fsanitize=thread
# would bring libtsan (it must be preloaded to load at all), and names the ones it needs.
_MODE_LINK = {"profile": ["-nodefaultlibs", "-lstdc++", "-lm", "-lgcc_s", "-lgcc", "-lc", "-ldl"]}
# Kernels pun types (uint4 loads of halves, float bits as int): g++ must not assume strict aliasing.
# Hidden visibility and no STB_GNU_UNIQUE keep each module's kernels and statics its own, even when two
# modules instantiate the same template. -fstack-clash-protection probes every page of a large frame in
# order, so a kernel whose locals overflow its fiber stack faults in the guard below it (and is reported)
# instead of landing wherever the frame's first write happens to reach.
_COMMON_FLAGS = ["-std=c++17", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden", "-fno-gnu-unique",
                 "-fno-strict-aliasing", "-fstack-clash-protection", "-fdiagnostics-plain-output"]


class CompileError(RuntimeError):
    """g++ refused the kernel source; the message carries its diagnostics with the kernel's line numbers."""


def compiler() -> str | None:
    """The C++ compiler the emulator uses: $CXX, else g++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(shlex.split(cxx)[0]) and cxx
    return shutil.which("g++")


@functools.lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    try:
        return subprocess.run(shlex.split(cxx) + ["--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return f"unknown ({e})"


def cache_dir() -> Path:
    root = os.environ.get("CUFLASH_SIMT_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "cuflash" / "simt"


def translate_options(options) -> tuple[list[str], bool]:
    """Map the options CuPy's RawModule takes onto g++: -D/-U/-I are honoured, --std is taken as given,
    -ftz=false turns off flushing denormals (CuPy always compiles with -ftz=true, so that is the default);
    other NVRTC options (-arch, --use_fast_math, -lineinfo ...) mean nothing on a CPU and are ignored."""
    flags, ftz = [], True
    it = iter(options)
    for opt in it:
        if opt in ("-D", "-U", "-I", "--define-macro", "--undefine-macro", "--include-path"):
            value = next(it, "")
            letter = {"--define-macro": "-D", "--undefine-macro": "-U", "--include-path": "-I"}.get(opt, opt)
            flags.append(letter + value)
        elif opt.startswith(("-D", "-U", "-I")):
            flags.append(opt)
        elif opt.startswith(("--define-macro=", "--undefine-macro=", "--include-path=")):
            key, value = opt.split("=", 1)
            flags.append({"--define-macro": "-D", "--undefine-macro": "-U", "--include-path": "-I"}[key] + value)
        elif opt.startswith(("-std=", "--std=")):
            flags.append("-std=" + opt.split("=", 1)[1])
        elif opt in ("-ftz=false", "--ftz=false"):
            ftz = False
        elif opt in ("-ftz=true", "--ftz=true", "--use_fast_math", "-use_fast_math"):
            ftz = True
    return flags, ftz


def flags_for(mode: str, options) -> list[str]:
    user, ftz = translate_options(options)
    return runtime_flags(mode, ftz) + user


def runtime_flags(mode: str, ftz: bool) -> list[str]:
    # The runtime header's directory comes first: it also holds stand-ins for cuda_fp16.h & co.
    return _COMMON_FLAGS + _MODE_FLAGS[mode] + ["-I" + str(HERE)] + (["-DCUFLASH_SIMT_FTZ"] if ftz else [])


def runtime_headers() -> list[Path]:
    """Every header the build can reach through -I HERE: cuflash_simt.h, its parts under runtime/, the stand-ins."""
    return sorted(p for p in HERE.rglob("*") if p.suffix in (".h", ".hpp") and p.is_file())


def _runtime_digest() -> str:
    h = hashlib.sha256()
    for p in runtime_headers():  # names relative to HERE: a moved part is a change too
        h.update(p.relative_to(HERE).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def build(tu: str, mode: str, options=(), display_name: str = "kernel.cu") -> Path:
    """Compile the translation unit; return the path of the cached shared library."""
    cxx = compiler()
    if cxx is None:
        raise CompileError("the SIMT emulator needs a C++17 compiler: install g++ or set $CXX")
    flags = flags_for(mode, options)
    key = hashlib.sha256("\0".join([tu, mode, *flags, compiler_version(cxx), _runtime_digest()]).encode())
    out_dir = cache_dir()
    out = out_dir / f"{key.hexdigest()[:40]}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    pch = precompiled_header(cxx, mode, options)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        src = Path(tmp) / "module.cpp"
        src.write_text(tu)
        lib = Path(tmp) / "module.so"
        # Debug info names the kernel source relative to the build directory, not this process's cwd.
        cmd = (shlex.split(cxx) + ([f"-I{pch}"] if pch else []) + flags +
               [f"-fdebug-prefix-map={tmp}=.", str(src), "-o", str(lib)] + _MODE_LINK.get(mode, []))
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if r.returncode != 0:
            raise CompileError(f"g++ could not compile {display_name} (mode {mode}):\n{r.stderr.strip()}")
        os.replace(lib, out)  # atomic: another process sees the whole file or none
    log_build(out, display_name, mode, options, time.perf_counter() - start)
    return out


def log_build(out: Path, display_name: str, mode: str, options, seconds: float) -> None:
    """With $CUFLASH_SIMT_BUILD_LOG set, append one JSON line per build actually made (not a cache hit): what was
    built, for which test, in how many seconds. The cold test suite's time is mostly these builds, so this is how
    it is kept within its budget."""
    path = os.environ.get("CUFLASH_SIMT_BUILD_LOG")
    if not path:
        return
    record = dict(library=out.name, source=display_name, mode=mode, seconds=round(seconds, 2),
                  options=[str(o) for o in options],
                  test=os.environ.get("PYTEST_CURRENT_TEST", ""))
    with open(path, "a") as f:  # one short write per line: lines from parallel workers do not interleave
        f.write(json.dumps(record) + "\n")


def precompiled_header(cxx: str, mode: str, options=()) -> Path | None:
    """A directory holding cuflash_simt.h precompiled for this mode and these options, which g++ finds ahead of
    the header itself (its -I comes first): a module then skips parsing the runtime, a third of its build. Built
    once per compiler, runtime and flags, beside the libraries. The options' -D and -U are left out, so modules
    that differ only in them share it: g++ checks that none changes what the header means, and parses the header
    itself where one does. None when g++ cannot make one (the build then parses the header, as before)."""
    user, ftz = translate_options(options)
    flags = [f for f in runtime_flags(mode, ftz) if f != "-shared"] + \
        [f for f in user if not f.startswith(("-D", "-U"))]
    key = hashlib.sha256("\0".join([*flags, compiler_version(cxx), _runtime_digest(), str(HERE)]).encode())
    where = cache_dir() / f"pch-{key.hexdigest()[:32]}"
    failed = where.with_suffix(".failed")
    if (where / "cuflash_simt.h.gch").exists() or failed.exists():
        return None if failed.exists() else where
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".pch-"))
    try:
        # The header beside its precompiled form: the kernels' own #include of it (common.cuh) must find a file.
        os.symlink(HERE / "cuflash_simt.h", tmp / "cuflash_simt.h")
        r = subprocess.run(shlex.split(cxx) + flags + ["-x", "c++-header", str(HERE / "cuflash_simt.h"), "-o",
                           str(tmp / "cuflash_simt.h.gch")], capture_output=True, text=True)
        if r.returncode != 0:
            failed.write_text(r.stderr)
            return None
        try:
            os.rename(tmp, where)  # atomic: another process sees the whole directory or none
        except OSError:
            pass  # another process won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return where


def check_syntax(tu: str, display_name: str = "kernel.cu") -> None:
    """Compile the translation unit without generating code: its static_asserts are evaluated, nothing is built
    or cached. CompileError carries g++'s diagnostics."""
    cxx = compiler()
    if cxx is None:
        raise CompileError("the SIMT emulator needs a C++17 compiler: install g++ or set $CXX")
    flags = [f for f in flags_for("fast", ()) if f not in ("-shared", "-fPIC")]
    r = subprocess.run(shlex.split(cxx) + flags + ["-fsyntax-only", "-x", "c++", "-"], input=tu,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"g++ rejected {display_name}:\n{r.stderr.strip()}")
