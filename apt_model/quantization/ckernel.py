"""An optional compiled CPU codec: the block loops of :mod:`~apt_model.quantization.blockwise` in C.

The pure-PyTorch block loop makes about a dozen passes over each chunk (multiply, four integer
ops for the table index, the lookup, packing). The same three loops written in C make one pass
each, vectorized by the compiler, and give the **same bits**: the same fp32 multiplications (IEEE,
no fused multiply-add: ``-ffp-contract=off``, no ``-ffast-math``), the same sign-cleared
bit-pattern maximum, and an E2M1 rounding that the tests check against
:func:`~apt_model.quantization.e2m1.reference_codes` on every top-16-bit pattern (and the whole
path against the PyTorch one, bit for bit).

The C source below is compiled on first use with the system C compiler (``cc``, or ``$CC``) into
a shared library cached under ``$APT_MODEL_CACHE`` (default ``~/.cache/apt_model``), keyed by a
hash of the source, the flags, the compiler's version and the CPU (it is built with
``-march=native`` where the compiler accepts it); it is loaded with :mod:`ctypes` (no
Python headers, no torch headers: compiling takes well under a second). Work is split over
``torch.get_num_threads()`` threads (ctypes releases the GIL during each call).

Where there is no C compiler, the compile fails, the tensors are not contiguous fp32 on the CPU,
or ``VB_FP4_KERNEL=torch`` is set, the pure-PyTorch path runs instead; :func:`status` says which
and why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from apt_model.base.log import get_logger
from apt_model.base.settings import read_env
from apt_model.quantization.settings import FP4_KERNEL

log = get_logger(__name__)

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Largest magnitude of each block: the maximum of the bit patterns with the sign cleared
   (orders values like their magnitudes; NaN patterns sort above Inf). */
void fp4_block_amax(const uint32_t *x, int64_t n_blocks, int64_t block, uint32_t *out) {
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint32_t *p = x + b * block;
        uint32_t m = 0;
        for (int64_t i = 0; i < block; i++) {
            uint32_t v = p[i] & 0x7FFFFFFFu;
            m = v > m ? v : m;
        }
        out[b] = m;
    }
}

/* E2M1 code of y: round to nearest even, saturating at 6, sign kept, NaN -> 0 (the rules of
   e2m1.reference_codes). |y| (clamped to 8) plus M = 2^(e+22), e = max(exponent of |y|, 0), has
   an ulp of exactly the E2M1 step of |y|'s binade (0.5 below 2), so (|y| + M) - M is |y| rounded
   to the E2M1 grid by the FPU's round-to-nearest-even; its fp32 bits give the code. */
static inline uint32_t e2m1_code(float y) {
    uint32_t u;
    memcpy(&u, &y, 4);
    uint32_t sign = (u >> 28) & 8u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t nan = a > 0x7F800000u;
    uint32_t ac = a < 0x41000000u ? a : 0x41000000u;
    uint32_t e = ac & 0x7F800000u;
    uint32_t mb = (e > 0x3F800000u ? e : 0x3F800000u) + (22u << 23);
    float af, m;
    memcpy(&af, &ac, 4);
    memcpy(&m, &mb, 4);
    float r = (af + m) - m;
    uint32_t rb;
    memcpy(&rb, &r, 4);
    uint32_t code = rb >= 0x3F800000u ? (rb >> 22) - 252u : rb >> 29;
    code = code < 7u ? code : 7u;
    return nan ? 0u : (sign | code);
}

/* codes of x * factor (the product rounded in fp32), packed two per byte, element 2i low. Runs of
   64 blocks are encoded as one flat loop (the block size a compile-time shift), which vectorizes
   whatever the block size; then packed. */
#define ENCODE_FIXED(NAME, SHIFT)                                                                  \
void NAME(const float *x, const float *factors, int64_t n_blocks, uint8_t *out) {                 \
    const int64_t block = (int64_t)1 << SHIFT;                                                     \
    uint8_t codes[64 << SHIFT];                                                                    \
    for (int64_t b0 = 0; b0 < n_blocks; b0 += 64) {                                               \
        const int64_t nb = n_blocks - b0 < 64 ? n_blocks - b0 : 64;                               \
        const float *p = x + b0 * block;                                                           \
        const float *f = factors + b0;                                                             \
        for (int64_t i = 0; i < (nb << SHIFT); i++) codes[i] = (uint8_t)e2m1_code(p[i] * f[i >> SHIFT]); \
        uint8_t *o = out + b0 * (block / 2);                                                       \
        for (int64_t i = 0; i < (nb << SHIFT) / 2; i++)                                           \
            o[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));                              \
    }                                                                                              \
}
ENCODE_FIXED(fp4_encode16, 4)
ENCODE_FIXED(fp4_encode32, 5)

/* any even block size up to 256 (slower: the loops are not vectorized as well) */
void fp4_encode(const float *x, const float *factors, int64_t n_blocks, int64_t block, uint8_t *out) {
    uint8_t codes[256];
    for (int64_t b = 0; b < n_blocks; b++) {
        const float f = factors[b];
        const float *p = x + b * block;
        for (int64_t i = 0; i < block; i++) codes[i] = (uint8_t)e2m1_code(p[i] * f);
        uint8_t *o = out + b * (block / 2);
        for (int64_t i = 0; i < block / 2; i++) o[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    }
}

/* out = value(code) * multiplier, two values per byte from a 256-entry table of value pairs. */
void fp4_decode(const uint8_t *packed, const float *multipliers, int64_t n_blocks, int64_t block,
                const float *pairs, float *out) {
    for (int64_t b = 0; b < n_blocks; b++) {
        const float m = multipliers[b];
        const uint8_t *p = packed + b * (block / 2);
        float *o = out + b * block;
        for (int64_t i = 0; i < block / 2; i++) {
            const float *v = pairs + 2 * p[i];
            o[2 * i] = v[0] * m;
            o[2 * i + 1] = v[1] * m;
        }
    }
}
"""

FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=c99")
#: Tried first, for the host's vector units (the library is cached per CPU, see :func:`_cpu_identity`).
NATIVE_FLAGS = ("-march=native",)
MAX_BLOCK = 256
_MIN_BLOCKS_PER_THREAD = 4096

_lock = threading.Lock()
_lib = None
_why = "not loaded yet"
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0


def _cache_dir() -> Path:
    from apt_model.base.user_cache import user_cache_dir

    return user_cache_dir() / "kernels"


def _cpu_identity() -> str:
    """The machine and its CPU feature flags: a library built with -march=native is only reused there."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    ident += line
    except OSError:
        ident += platform.processor()
    return ident


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc.split()[0]):
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _compile() -> tuple[ctypes.CDLL | None, str]:
    if (read_env(FP4_KERNEL) or (FP4_KERNEL.default,))[0] == "torch":
        return None, f"{FP4_KERNEL.env}=torch: the pure-PyTorch codec was requested"
    if sys.byteorder != "little":
        return None, "big-endian host: the compiled codec assumes little-endian"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc, clang or $CC) found: using the pure-PyTorch codec"
    try:
        version = subprocess.run(cc.split() + ["--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{cc} --version failed ({err}): using the pure-PyTorch codec"
    key = hashlib.sha256("\n".join([C_SOURCE, " ".join(FLAGS), version, _cpu_identity()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"fp4_codec_{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "fp4_codec.c"
                src.write_text(C_SOURCE, encoding="utf-8")
                out = Path(tmp) / target.name
                errors = ""
                for extra in (NATIVE_FLAGS, ()):  # without -march=native if the compiler refuses it
                    r = subprocess.run(cc.split() + list(FLAGS) + list(extra) + [str(src), "-o", str(out)],
                                       capture_output=True, text=True, timeout=120)
                    if r.returncode == 0:
                        break
                    errors = r.stderr.strip()[:300]
                else:
                    return None, f"compiling the FP4 codec failed: {errors}"
                os.replace(out, target)  # atomic: concurrent builders agree on one file
        except (OSError, subprocess.SubprocessError) as err:
            return None, f"could not build the FP4 codec in {target.parent}: {err}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return None, f"could not load {target}: {err}"
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.fp4_block_amax.argtypes = [vp, i64, i64, vp]
    lib.fp4_encode.argtypes = [vp, vp, i64, i64, vp]
    lib.fp4_encode16.argtypes = lib.fp4_encode32.argtypes = [vp, vp, i64, vp]
    lib.fp4_decode.argtypes = [vp, vp, i64, i64, vp, vp]
    for fn in (lib.fp4_block_amax, lib.fp4_encode, lib.fp4_encode16, lib.fp4_encode32, lib.fp4_decode):
        fn.restype = None
    return lib, f"compiled C codec {target}"


def library() -> ctypes.CDLL | None:
    """The loaded codec, compiling it on first call; None when unavailable (see :func:`status`)."""
    global _lib, _why
    if _why == "not loaded yet":
        with _lock:
            if _why == "not loaded yet":
                _lib, _why = _compile()
                log.debug("fp4 codec: %s", _why)
    return _lib


def status() -> dict:
    """``{"compiled": bool, "reason": str}`` — which CPU codec runs, and why."""
    lib = library()
    return {"compiled": lib is not None, "reason": _why}


def reset() -> None:
    """Forget the loaded codec (tests; or after changing ``VB_FP4_KERNEL``)."""
    global _lib, _why
    with _lock:
        _lib, _why = None, "not loaded yet"


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the compiled codec can take these tensors (CPU, contiguous) and is available."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and library() is not None


def _split(n_blocks: int) -> list[tuple[int, int]]:
    """Block ranges: 4 per thread (so a thread on a core another process is using takes fewer),
    each at least ``_MIN_BLOCKS_PER_THREAD`` blocks; one range when there is one thread."""
    if n_blocks == 0:
        return []
    threads = torch.get_num_threads()
    parts = 1 if threads == 1 else max(1, min(4 * threads, n_blocks // _MIN_BLOCKS_PER_THREAD))
    step = -(-n_blocks // parts)
    return [(s, min(s + step, n_blocks)) for s in range(0, n_blocks, step)]


def _run(calls) -> None:
    """Run ``calls`` (zero-argument callables) on ``torch.get_num_threads()`` pool threads, which take
    them in turn (inline when there is one call or one thread)."""
    global _pool, _pool_size, _pool_pid
    workers = min(len(calls), torch.get_num_threads())
    if workers <= 1:
        for c in calls:
            c()
        return
    with _lock:
        # a forked child inherits the pool object but not its threads: start a new one there
        if _pool is None or _pool_size != workers or _pool_pid != os.getpid():
            if _pool is not None and _pool_pid == os.getpid():
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="apt-fp4")
            _pool_size, _pool_pid = workers, os.getpid()
        pool = _pool
    for f in [pool.submit(c) for c in calls]:
        f.result()


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 ``(n_blocks, block)`` -> float32 ``(n_blocks,)`` block maxima of ``|x|`` (NaN-aware)."""
    n, block = blocks.shape
    out = torch.empty(n, dtype=torch.float32)
    lib, x, o = library(), blocks.data_ptr(), out.data_ptr()
    _run([lambda s=s, e=e: lib.fp4_block_amax(x + 4 * s * block, e - s, block, o + 4 * s) for s, e in _split(n)])
    return out


def encode(blocks: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """fp32 ``(n_blocks, block)`` x float32 ``(n_blocks,)`` -> packed uint8 ``(n_blocks, block // 2)``."""
    n, block = blocks.shape
    if block > MAX_BLOCK or block % 2:
        raise ValueError(f"the compiled codec takes even blocks of at most {MAX_BLOCK} elements, got {block}")
    out = torch.empty(n, block // 2, dtype=torch.uint8)
    factors = factors.contiguous()
    lib, x, f, o = library(), blocks.data_ptr(), factors.data_ptr(), out.data_ptr()
    half = block // 2
    fixed = {16: lib.fp4_encode16, 32: lib.fp4_encode32}.get(block)
    if fixed is not None:
        calls = [lambda s=s, e=e: fixed(x + 4 * s * block, f + 4 * s, e - s, o + s * half) for s, e in _split(n)]
    else:
        calls = [lambda s=s, e=e: lib.fp4_encode(x + 4 * s * block, f + 4 * s, e - s, block, o + s * half)
                 for s, e in _split(n)]
    _run(calls)
    return out


def decode(packed: torch.Tensor, multipliers: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """packed uint8 ``(n_blocks, block // 2)`` x float32 ``(n_blocks,)`` -> float32 ``(n_blocks, block)``."""
    n, half = packed.shape
    block = half * 2
    out = torch.empty(n, block, dtype=torch.float32)
    multipliers = multipliers.contiguous()
    lib, p, m, t, o = library(), packed.data_ptr(), multipliers.data_ptr(), pairs.data_ptr(), out.data_ptr()
    _run([lambda s=s, e=e: lib.fp4_decode(p + s * half, m + 4 * s, e - s, block, t, o + 4 * s * block)
          for s, e in _split(n)])
    return out
