"""The cuda backend's launch and scan plumbing, below its kernels: launching a
compiled Numba kernel below Numba's dispatcher (RawKernel, Prepared: the
driver's cuLaunchKernel with parameters laid out once), dynamic shared memory,
and the NaN/infinity scan of attention(check_finite=True) on GPU arrays (one
launch over up to four arrays, flags in mapped host memory, one wait; under
the simulator a plain kernel per array). Importing it imports numba.cuda."""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading
import time
from typing import NamedTuple

import numpy as np
from numba import config, cuda

from ..._gpuarray import GpuArray

LOG2E = math.log2(math.e)  # scores in the log2 domain: exp(s) = 2^(s * LOG2E)
LN2 = math.log(2.0)  # back from the log2 domain: ln(x) = log2(x) * LN2
SHARED_BYTES = 48 * 1024  # static shared memory per block (CUDA's limit without opt-in)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------- attention features

class KernelFeatures(NamedTuple):
    """A featured call's features (_registry.Features) as cuda.flash's kernels take
    them: k/v rows shared by kv_group query rows; lens, the key length of each
    sequence of seq_rows consecutive batch rows (an int32 GpuArray, or None: every
    key); bottom_right alignment (0 or 1); window sides (-1 unbounded, causal is
    not folded in); the softcap c > 0 in natural units (0: none); the attention
    mask (a 4-D GpuArray with byte strides, 0 where broadcast, or None), its kind
    (MASK_KINDS: 0 none) and the heads of the folded batch row (b // mask_heads,
    b % mask_heads); dropout's probability (0: none), seed and (query, key) counter
    offsets (attnkern._philox): the Numba kernels and the float16/bfloat16 CUDA C++ ones take them;
    packed varlen sequences (cu_q, cu_k: the float16/bfloat16 CUDA C++ kernels only)."""

    kv_group: int
    lens: object
    seq_rows: int
    bottom_right: int
    window_left: int
    window_right: int
    softcap: float
    mask: object = None
    mask_kind: int = 0
    mask_heads: int = 1
    alibi: object = None  # ALiBi's slopes, one per batch row (a GpuArray of the kernels' float), or None
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_offset: tuple = (0, 0)
    # packed sequences: int32 GpuArrays of cu_seqlens_q and cu_seqlens_k (None: not varlen), the
    # stride of ALiBi's slopes between sequences (0: shared) and the longest query and key counts
    cu_q: object = None
    cu_k: object = None
    alibi_seq_stride: int = 0
    max_q: int = 0
    max_k: int = 0

    @property
    def sequences(self) -> int:
        """The packed sequences of a varlen call (0: not varlen)."""
        return 0 if self.cu_q is None else self.cu_q.shape[0] - 1

    def mask_strides(self) -> tuple:
        """The mask's four strides in elements (0: none or broadcast)."""
        if self.mask is None:
            return (0, 0, 0, 0)
        return tuple(st // self.mask.dtype.itemsize for st in self.mask.strides)

    @classmethod
    def of(cls, features, batch: int, dtype=np.float32) -> "KernelFeatures | None":
        """None for None (a plain call), else the kernels' form; the key lengths and
        ALiBi's slopes (float64 for float64 q, else float32) are copied to the GPU."""
        if features is None:
            return None
        lens, seq_rows = None, max(batch, 1)
        if features.key_lengths is not None:
            host = np.ascontiguousarray(features.key_lengths, dtype=np.int32)
            lens, seq_rows = _device_lengths(host.tobytes()), max(batch // max(len(host), 1), 1)
        mask = features.mask
        if mask is not None and not isinstance(mask, GpuArray):
            mask = _device_mask(mask)
        kind = 0 if mask is None else MASK_KINDS[mask.dtype.name]
        alibi = None
        if features.alibi is not None:
            from .arrays import from_host

            wide = np.float64 if np.dtype(dtype) == np.float64 else np.float32
            alibi = from_host(np.ascontiguousarray(features.alibi, dtype=wide))
        varlen = {}
        if features.cu_seqlens_q is not None:
            cu_q, cu_k = (np.ascontiguousarray(c, dtype=np.int32) for c in (features.cu_seqlens_q,
                                                                            features.cu_seqlens_k))
            varlen = dict(cu_q=_device_lengths(cu_q.tobytes()), cu_k=_device_lengths(cu_k.tobytes()),
                          alibi_seq_stride=int(features.alibi_seq_stride), max_q=int(np.diff(cu_q).max(initial=0)),
                          max_k=int(np.diff(cu_k).max(initial=0)))
        return cls(int(features.kv_group), lens, seq_rows, int(features.align == "bottom_right"),
                   int(features.window_left), int(features.window_right), float(features.softcap), mask, kind,
                   int(features.mask_heads), alibi, float(features.dropout_p), int(features.dropout_seed),
                   tuple(int(x) for x in features.dropout_offset), **varlen)

    def words(self, cap_unit: float) -> tuple:
        """The CUDA C++ kernels' FEAT_PARAMS: the softcap and an additive mask's
        values divided by cap_unit, the size of one unit of the kernel's scores
        (its scores are c tanh(s / c))."""
        ptr = 0 if self.mask is None else self.mask.ptr
        # varlen: seq_rows carries the stride of ALiBi's slopes between sequences (flash_common.cuh)
        seq_rows = self.seq_rows if self.cu_q is None else self.alibi_seq_stride
        varlen = (np.uint64(0), np.uint64(0)) if self.cu_q is None else (Addr(self.cu_q), Addr(self.cu_k))
        return (np.int32(self.kv_group), np.uint64(0) if self.lens is None else Addr(self.lens),
                np.int32(seq_rows), np.int32(self.bottom_right), np.int32(self.window_left),
                np.int32(self.window_right), np.float32(self.softcap / cap_unit),
                np.uint64(ptr), np.int32(self.mask_kind), np.int32(self.mask_heads),
                *(np.uint64(st) for st in self.mask_strides()), np.float32(1.0 / cap_unit),
                np.uint64(0) if self.alibi is None else Addr(self.alibi), np.float32(1.0 / cap_unit),
                *self.dropout_words(), *varlen)

    def dropout_words(self) -> tuple:
        """FEAT_PARAMS' dropout words (dseed, dthr, dscale, di0, dj0): the seed, the keep
        threshold round(p 2^32), 1 / (1 - p) in float32 and the query and key counter
        offsets (attnkern._philox, taken mod 2^64); zeros without dropout."""
        if not self.dropout_p > 0:
            return PLAIN_WORDS[-7:-2]
        from ... import _philox

        i0, j0 = (int(x) % 2**64 for x in self.dropout_offset)
        return (np.uint64(self.dropout_seed % 2**64), np.uint64(_philox.threshold(self.dropout_p)),
                np.float32(1.0 / (1.0 - self.dropout_p)), np.uint64(i0), np.uint64(j0))


# the attention mask's dtypes as the kernels name them (flash_common.cuh's MASK_*)
MASK_KINDS = {"bool": 1, "float32": 2, "float16": 3, "bfloat16": 4, "float64": 5}


def _device_mask(mask: np.ndarray) -> GpuArray:
    """A host call's 4-D mask (broadcast dimensions of size 1) copied to the GPU, as
    the 4-D GpuArray view the kernels take (byte strides, 0 where broadcast)."""
    from .arrays import from_host

    host = np.ascontiguousarray(mask)
    flat = from_host(host.reshape(-1))
    strides = tuple(0 if n == 1 else st for n, st in zip(host.shape, host.strides))
    return GpuArray(host.shape, host.dtype, strides, flat.flat, ptr=flat.ptr, contiguous=True)


_LENGTHS: dict = {}  # (device, int32 bytes) -> the lengths on that device (never written: shared by calls)


def _device_lengths(raw: bytes):
    """Key lengths (int32 bytes) as a GpuArray on the current device, copied once per
    distinct lengths (a copy and an allocation per call would cost more than a short call)."""
    from .arrays import from_host

    key = (None if config.ENABLE_CUDASIM else cuda.get_current_device().id, raw)
    lens = _LENGTHS.get(key)
    if lens is None:
        if len(_LENGTHS) > 256:
            _LENGTHS.clear()
        lens = _LENGTHS[key] = from_host(np.frombuffer(raw, np.int32).copy())
    return lens


# the FEAT_PARAMS of a plain call (their values are ignored by the plain kernels)
PLAIN_WORDS = (np.int32(1), np.uint64(0), np.int32(1), np.int32(0), np.int32(-1), np.int32(-1), np.float32(0),
               np.uint64(0), np.int32(0), np.int32(1), *(np.uint64(0),) * 4, np.float32(0), np.uint64(0), np.float32(0),
               np.uint64(0), np.uint64(0), np.float32(0), np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0))
# FEAT_PARAMS, as _linked_kernel spells them
FEAT_TYPES = ("i32", "u64", "i32", "i32", "i32", "i32", "f32", "u64", "i32", "i32", "u64", "u64", "u64", "u64", "f32",
              "u64", "f32", "u64", "u64", "f32", "u64", "u64", "u64", "u64")


# ---------------------------------------------------------------- launches

class RawKernel:
    """A compiled Numba kernel launched below Numba's dispatcher, with the driver's
    cuLaunchKernel (through cuda.bindings) on the legacy default stream, as Numba's
    own launches: no typing of Python values, no array objects, no launch
    configuration objects per call. That dispatch is most of a call's overhead
    at small sizes. Parameters come as the address of an array of pointers to
    their values (Prepared)."""

    def __init__(self, compiled, shared: int = 0):
        from cuda.bindings import driver as cu

        handle = compiled._codelibrary.get_cufunc().handle  # a CUkernel or CUfunction: both launch
        self._function = cu.CUfunction(int(handle))
        self._shared = shared  # dynamic shared memory bytes of every launch
        self._stream = cu.CUstream(_LEGACY_STREAM)
        self._launch = cu.cuLaunchKernel
        self._success = cu.CUresult.CUDA_SUCCESS

    def __call__(self, grid: tuple, block: tuple, params: int) -> None:
        if not getattr(_THREAD, "context", False):  # the context must be current on this thread
            cuda.current_context()
            _THREAD.context = True
        (err,) = self._launch(self._function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                              self._shared, self._stream, params, 0)
        if err != self._success:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def shared_limit() -> int:
    """The most shared memory one block may have on the current GPU (with the
    kernel's limit raised), or the static limit where there is no GPU (the simulator)."""
    if config.ENABLE_CUDASIM:
        return SHARED_BYTES
    return _optin_limit(cuda.get_current_device().id)


@functools.cache  # asked on every call that picks a tile; a device's limit does not change
def _optin_limit(device_id: int) -> int:
    return cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


def dynamic_raw_kernel(compiled, shared: int) -> RawKernel:
    """The RawKernel of a compiled kernel that takes `shared` bytes of dynamic shared
    memory, its limit raised to that (the driver refuses launches above 48 KB without)."""
    from numba.cuda.cudadrv import driver as nbdriver

    limit = shared_limit()
    if shared > limit:
        raise ValueError(f"a kernel needs {shared} bytes of shared memory; this GPU allows {limit}")
    cufunc = compiled._codelibrary.get_cufunc()
    attr = nbdriver.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    nbdriver.driver.cuKernelSetAttribute(attr, shared, cufunc.handle, cufunc.device.id)
    return RawKernel(compiled, shared)


_THREAD = threading.local()  # per thread: whether Numba made its context current there
_LEGACY_STREAM = 0  # the stream handle our kernels run on, as Numba's own launches
_RAW: dict = {}  # dispatcher -> RawKernel; each of our dispatchers is always called with one signature
_RAW_LOCK = threading.Lock()
_DYNAMIC_SHARED: dict = {}  # dispatcher -> bytes of dynamic shared memory its launches take


def _dim3(x) -> tuple:
    x = (x,) if isinstance(x, int) else tuple(x)
    return x + (1,) * (3 - len(x))


class Addr:
    """A kernel argument that is a GpuArray's device address, as a uint64 (the
    CUDA C++ kernels take their arrays so)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


class TensorMap:
    """A kernel argument that is the global address of a TMA descriptor (CUtensorMap) of a
    GpuArray (batch, n, d) of 2-byte elements, d = 64 or 128 (flash_wgmma.cu's ATTNKERN_TMA):
    3-D (d, n, batch), boxes of 64 columns x box_rows rows x 1, the 128-byte swizzle of the
    wgmma layout, rows past n read as zeros. A Prepared launch maps each call's address to its
    descriptor (tensor_map_address)."""

    __slots__ = ("array", "box_rows")

    def __init__(self, array, box_rows: int):
        self.array, self.box_rows = array, box_rows

    def address(self, ptr: int) -> int:
        return tensor_map_address(ptr, self.array.shape, self.box_rows)


MAP_BYTES, MAP_SLOTS = 128, 1024  # a descriptor's bytes (64-byte aligned), descriptors kept per device
_MAPS: dict = {}  # (array address, shape, box rows) -> its descriptor's global address
_MAP_POOLS: dict = {}  # device id -> [device memory of MAP_SLOTS descriptors, its address, slots used]
_MAP_RETIRED: list = []  # the last MAP_RETIRED full pools, kept alive for launches still using them
MAP_RETIRED = 4
_MAP_LOCK = threading.Lock()


def tensor_map_address(ptr: int, shape: tuple, box_rows: int) -> int:
    """The global address of the TMA descriptor of the array (batch, n, d) at ptr (TensorMap),
    encoded (cuTensorMapEncodeTiled) and copied to the current device once per (address, shape,
    box): a descriptor depends on nothing else, so a call on the same memory (torch's caching
    allocator hands addresses out again) reuses it. Descriptors live in a pool of MAP_SLOTS per
    device, never written twice: a full pool's addresses are forgotten and a new pool takes over,
    the full one kept alive until MAP_RETIRED newer ones have filled (a launch that looked an
    address up just before still reads its own descriptor). The copy runs on the legacy default
    stream, as the kernels."""
    key = (ptr, shape, box_rows)
    at = _MAPS.get(key)
    if at is not None:
        return at
    raw = _encode_tensor_map(ptr, shape, box_rows)
    with _MAP_LOCK:
        device = _device_id()
        pool = _MAP_POOLS.get(device)
        if pool is not None and pool[2] == MAP_SLOTS:  # full: its addresses forgotten, the pool retired
            for k in [k for k, a in _MAPS.items() if pool[1] <= a < pool[1] + MAP_SLOTS * MAP_BYTES]:
                del _MAPS[k]
            _MAP_RETIRED.append(pool)
            del _MAP_RETIRED[:-MAP_RETIRED]
            pool = None
        if pool is None:
            pool = _MAP_POOLS[device] = _new_map_pool()
        slot = pool[2]
        _write_map(pool, slot, raw)
        pool[2] += 1
        at = _MAPS[key] = pool[1] + slot * MAP_BYTES
    return at


def _encode_tensor_map(ptr: int, shape: tuple, box_rows: int) -> np.ndarray:
    """The MAP_BYTES bytes of tensor_map_address's descriptor (3-D: d, n, batch; boxes of 64 x
    box_rows x 1 two-byte elements, 128-byte swizzle, zeros out of bounds)."""
    from cuda.bindings import driver as cu

    batch, n, d = (max(int(x), 1) for x in shape)
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, ptr, [u64(d), u64(n), u64(batch)],
        [u64(2 * d), u64(2 * d * n)], [u32(64), u32(box_rows), u32(1)], [u32(1), u32(1), u32(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    _check(err, "cuTensorMapEncodeTiled")
    return np.frombuffer(ctypes.string_at(tmap.getPtr(), MAP_BYTES), np.uint8)


def _device_id() -> int:
    return cuda.get_current_device().id


def _new_map_pool() -> list:
    """A pool of MAP_SLOTS descriptors on the current device: [its memory, address, slots used]."""
    memory = cuda.device_array(MAP_SLOTS * MAP_BYTES, np.uint8)
    return [memory, memory.device_ctypes_pointer.value, 0]


def _write_map(pool: list, slot: int, raw: np.ndarray) -> None:
    pool[0][slot * MAP_BYTES:(slot + 1) * MAP_BYTES].copy_to_device(raw)


_MASK64 = (1 << 64) - 1
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _words(args, roles=()):
    """Kernel arguments as Numba's calling convention lays them out, one 64-bit
    word per parameter (a narrower value in its low bytes, which is all the
    driver copies): a GpuArray as the fields of Numba's 1-D C-contiguous array
    (meminfo, parent, size, itemsize, data pointer, shape, stride), an Addr as
    its array's address, a TensorMap as its descriptor's address, a bool as is, Python ints
    and floats as the C types Numba types them as (int64, float64), NumPy scalars as their
    own. Returns (words, [(word index, role index, None or a TensorMap's address function)])
    where a GpuArray's, an Addr's or a TensorMap's array is `roles[role index]` (by identity)."""
    words, slots = [], []
    for a in args:
        array = a.array if isinstance(a, (Addr, TensorMap)) else a if isinstance(a, GpuArray) else None
        if array is not None:
            role = next((i for i, r in enumerate(roles) if r is array), None)
            if isinstance(a, TensorMap):  # a role's descriptor is looked up per call
                at = len(words)
                words.append(0 if role is not None else a.address(array.ptr))
                if role is not None:
                    slots.append((at, role, a.address))
                continue
            if isinstance(a, GpuArray):
                n, itemsize = a.size, a.dtype.itemsize
                words += (0, 0, n, itemsize)
                at = len(words)
                words += (a.ptr, n, itemsize)
            else:
                at = len(words)
                words.append(array.ptr)
            if role is not None:
                slots.append((at, role, None))
        elif isinstance(a, bool):
            words.append(int(a))
        elif isinstance(a, int):
            words.append(a & _MASK64)
        elif isinstance(a, float):
            words.append(struct.unpack("<Q", struct.pack("<d", a))[0])
        else:  # a NumPy scalar: its own bits
            words.append(int(a.view(_UINT[a.dtype.itemsize])))
    return words, slots


class Prepared:
    """One kernel's launch with everything fixed but some arrays' addresses:
    calling it with the addresses of the roles (in order) writes them into its
    parameter words and launches. Its parameter memory is its own: use one from
    one thread at a time."""

    def __init__(self, raw: RawKernel, grid, block, args, roles=()):
        words, self._slots = _words(args, roles)
        self._raw, self._grid, self._block = raw, _dim3(grid), _dim3(block)
        self._words = (ctypes.c_uint64 * max(len(words), 1))(*words)
        base = ctypes.addressof(self._words)
        self._params = (ctypes.c_void_p * max(len(words), 1))(*range(base, base + 8 * len(words), 8))
        self._params_at = ctypes.addressof(self._params)

    def __call__(self, *ptrs) -> None:
        words = self._words
        for at, role, mapped in self._slots:
            words[at] = ptrs[role] if mapped is None else mapped(ptrs[role])
        self._raw(self._grid, self._block, self._params_at)


def register_raw(dispatcher, raw: RawKernel) -> None:
    """Launches of dispatcher go through raw from now on (a kernel compiled for its one signature)."""
    with _RAW_LOCK:
        _RAW[dispatcher] = raw


def take_dynamic_shared(dispatcher, shared: int) -> None:
    """dispatcher's launches take `shared` bytes of dynamic shared memory, its limit raised on the first."""
    _DYNAMIC_SHARED[dispatcher] = shared


def raw_kernel(dispatcher):
    """The RawKernel of a dispatcher that has been launched once (compiled), else None."""
    return None if config.ENABLE_CUDASIM else _RAW.get(dispatcher)


def launch(dispatcher, grid, block, *args) -> None:
    """dispatcher[grid, block](*args) where each GpuArray argument is passed as its
    flat 1-D Numba view and an Addr as its array's address (a uint64). The first
    launch of a dispatcher goes through Numba (it compiles there); later ones
    through RawKernel, the arguments laid out as _words says."""
    raw = raw_kernel(dispatcher)
    if raw is None:
        flat = [a.flat if isinstance(a, GpuArray) else np.uint64(a.array.ptr) if isinstance(a, Addr)
                else np.uint64(a.address(a.array.ptr)) if isinstance(a, TensorMap) else a for a in args]
        shared = _DYNAMIC_SHARED.get(dispatcher, 0)
        if shared and not config.ENABLE_CUDASIM:
            # the limit must be raised before the first launch: compile for these
            # arguments' types, raise it, and launch below the dispatcher from now on
            compiled = dispatcher.compile(tuple(dispatcher.typeof_pyval(a) for a in flat))
            with _RAW_LOCK:
                _RAW.setdefault(dispatcher, dynamic_raw_kernel(compiled, shared))
            return launch(dispatcher, grid, block, *args)
        dispatcher[grid, block, 0, shared](*flat)
        if not config.ENABLE_CUDASIM:
            with _RAW_LOCK:
                if dispatcher not in _RAW and len(dispatcher.overloads) == 1:
                    _RAW[dispatcher] = RawKernel(next(iter(dispatcher.overloads.values())))
        return
    Prepared(raw, grid, block, args)()


# ---------------------------------------------------------------- finite checks

SCAN_BLOCKS, SCAN_THREADS = (2, 32) if config.ENABLE_CUDASIM else (528, 256)
# the exponent bits, all set for NaN and infinity, of each float dtype's bit pattern
_EXPONENT = {"float16": (np.uint16, 0x7C00), "bfloat16": (np.uint16, 0x7F80),
             "float32": (np.uint32, 0x7F800000), "float64": (np.uint64, 0x7FF0000000000000)}


def _word_constants(itemsize: int, mask: int):
    """(mask, add) for 64-bit words of 8 // itemsize lanes: each lane's exponent bits
    (mask) and their lowest bit (add). A lane's exponent bits x are at most mask, in
    steps of add, so x + add stays within the lane and reaches its top bit (mask + add,
    the sign bit) exactly when every exponent bit is set: NaN or infinity."""
    lanes = 8 // itemsize
    add = mask & -mask
    spread = sum(1 << (8 * itemsize * i) for i in range(lanes))
    return np.uint64(mask * spread), np.uint64(add * spread)


@functools.cache
def nonfinite_kernel(itemsize: int):
    """A scan of up to four flat arrays of one width: flags[i] = 1 where array i has
    an element whose exponent bits are all set. Each array comes twice: its first nw
    64-bit words (8 // itemsize elements each; nw is 0 where the address is not
    8-byte aligned) and its n elements as unsigned integers of their width, of which
    those past the words are read one by one. The words' loop takes four per thread
    per step and keeps no branch on the data (their lanes' tests are ORed), so that
    a thread's loads are in flight together. On an H100 this read q, k, v and the
    output of (8, 16, 16384, 128) bfloat16 at 2.8 TB/s (0.77 ms), where one 2-byte
    load per step, with a branch on each, read 0.65 TB/s (3.3 ms; docs/triton.md)."""
    lanes = 8 // itemsize

    @cuda.jit(device=True)
    def seen(words, nw, elems, n, wmask, wadd, emask, start, stride):
        acc = wmask ^ wmask  # a uint64 zero
        i = start
        while i + 3 * stride < nw:
            acc |= (((words[i] & wmask) + wadd) | ((words[i + stride] & wmask) + wadd)
                    | ((words[i + 2 * stride] & wmask) + wadd) | ((words[i + 3 * stride] & wmask) + wadd))
            i += 4 * stride
        while i < nw:
            acc |= (words[i] & wmask) + wadd
            i += stride
        hit = (acc & (wmask + wadd)) != 0
        for j in range(nw * lanes + start, n, stride):
            if (elems[j] & emask) == emask:
                hit = True
        return hit

    @cuda.jit
    def scan(w0, w1, w2, w3, e0, e1, e2, e3, nw0, nw1, nw2, nw3, n0, n1, n2, n3, wmask, wadd, emask, flags):
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        if seen(w0, nw0, e0, n0, wmask, wadd, emask, start, stride):
            flags[0] = 1
        if seen(w1, nw1, e1, n1, wmask, wadd, emask, start, stride):
            flags[1] = 1
        if seen(w2, nw2, e2, n2, wmask, wadd, emask, start, stride):
            flags[2] = 1
        if seen(w3, nw3, e3, n3, wmask, wadd, emask, start, stride):
            flags[3] = 1

    return scan


_FLAGS = threading.local()  # per thread: mapped host memory the scan writes its four flags to
_NO_FLAGS = bytes(16)


def _flags():
    """This thread's four flags: (a GpuArray over them, their host address, the mapped array)."""
    f = getattr(_FLAGS, "f", None)
    if f is None:
        host = cuda.mapped_array(4, dtype=np.int32)
        view = GpuArray((4,), np.int32, None, ptr=host.device_ctypes_pointer.value or 0, owner=host)
        f = _FLAGS.f = (view, host.ctypes.data, host)
    return f


def _scan_launch(arrays, flags, words=None):
    """((kernel, grid, block, args), word views, element views) of one scan over up to
    four GpuArrays of one dtype: each as 64-bit words where words (default: every
    address 8-byte aligned) and as unsigned integers of its width, a grid no larger
    than the largest needs; the views padded to four with the first's (n = 0)."""
    itype, mask = _EXPONENT[arrays[0].dtype.name]
    size = np.dtype(itype).itemsize
    lanes = 8 // size
    if words is None:
        words = all(a.ptr % 8 == 0 for a in arrays)
    elems = [GpuArray((a.size,), itype, None, ptr=a.ptr, owner=a.owner) for a in arrays]
    nws = [a.size // lanes if words else 0 for a in arrays]
    wide = [GpuArray((nw,), np.uint64, None, ptr=a.ptr, owner=a.owner) for a, nw in zip(arrays, nws)]
    sizes = [x.size for x in elems] + [0] * (4 - len(elems))
    nws += [0] * (4 - len(nws))
    while len(elems) < 4:
        elems.append(elems[0])
        wide.append(wide[0])
    loads = max(max(nw, n - nw * lanes) for nw, n in zip(nws, sizes))
    blocks = max(1, min(SCAN_BLOCKS, -(-loads // SCAN_THREADS)))
    wmask, wadd = _word_constants(size, mask)
    return ((nonfinite_kernel(size), blocks, SCAN_THREADS,
             (*wide, *elems, *nws, *sizes, wmask, wadd, itype(mask), flags)), wide, elems)


def scan_launch(arrays):
    """(kernel, grid, block, args) of the finite scan over up to four GpuArrays of one dtype, as a
    call's check launches it, writing this thread's flags (its last argument): for measuring the
    scan alone (launch() it; nothing waits for it or reads the flags)."""
    return _scan_launch(arrays, _flags()[0])[0]


SPIN_S = 1e-3  # how long _wait polls before it leaves the wait to the driver
_DRIVER = []  # cuda.bindings.driver and the legacy default stream's handle object, found on first use


def _driver():
    if not _DRIVER:
        from cuda.bindings import driver as cu

        _DRIVER.extend((cu, cu.CUstream(_LEGACY_STREAM)))
    return _DRIVER


def _wait() -> None:
    """Waits for the legacy default stream, which our kernels run on: records an
    event there and polls it for up to SPIN_S, then waits in the driver. A wait
    in the driver can put the thread to sleep, and waking it costs tens of
    microseconds, more than the finite checks' whole wait at small sizes."""
    cu, stream = _driver()
    event = getattr(_FLAGS, "event", None)
    if event is None:
        err, event = cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        _check(err, "cuEventCreate")
        _FLAGS.event = event  # one per thread, kept for the thread's life
    _check(cu.cuEventRecord(event, stream)[0], "cuEventRecord")
    query, not_ready, deadline = cu.cuEventQuery, cu.CUresult.CUDA_ERROR_NOT_READY, None
    while True:
        (err,) = query(event)
        if err != not_ready:
            return _check(err, "cuEventQuery")
        if deadline is None:
            deadline = time.perf_counter() + SPIN_S
        elif time.perf_counter() > deadline:
            return _check(cu.cuEventSynchronize(event)[0], "cuEventSynchronize")


def _check(err, what: str) -> None:
    if err != _driver()[0].CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err!r}")


def nonfinite(arrays) -> list[bool]:
    """For each GpuArray, whether it holds a NaN or an infinity: up to four of one
    itemsize in one launch, flags in mapped host memory, one wait; under the
    simulator, or for more arrays, one plain scan each."""
    if config.ENABLE_CUDASIM or len(arrays) > 4:
        return [_nonfinite_slow(x) for x in arrays]
    view, at, _ = _flags()
    ctypes.memset(at, 0, 16)
    kernel, grid, block, args = _scan_launch(arrays, view)[0]
    launch(kernel, grid, block, *args)
    _wait()
    return [bool(f) for f in np.frombuffer(ctypes.string_at(at, 16), np.int32)[:len(arrays)]]


class FiniteScan:
    """nonfinite() prepared for arrays of fixed dtype and sizes at addresses given
    per call: calling it with the arrays' addresses returns whether any of them
    holds a NaN or an infinity (by 64-bit words where every address is 8-byte
    aligned, else element by element). prepare() returns None until the scan has
    been launched once (compiled). It writes this thread's flags: one thread's."""

    def __init__(self, words, elements, at):
        self._words, self._elements, self._at = words, elements, at

    @classmethod
    def prepare(cls, dtype, sizes):
        view, at, _ = _flags()
        roles = [GpuArray((n,), dtype, None, ptr=0) for n in sizes]
        prepared = []
        for words in (True, False):
            (kernel, grid, block, args), wide, elems = _scan_launch(roles, view, words)
            raw = raw_kernel(kernel)
            if raw is None:
                return None
            # each address fills its array's two views
            prepared.append(Prepared(raw, grid, block, args, wide[:len(sizes)] + elems[:len(sizes)]))
        return cls(*prepared, at)

    def __call__(self, *ptrs) -> bool:
        ctypes.memset(self._at, 0, 16)
        aligned = not any(p & 7 for p in ptrs)
        (self._words if aligned else self._elements)(*ptrs, *ptrs)
        _wait()
        return ctypes.string_at(self._at, 16) != _NO_FLAGS


_SLOW_THREADS = 32 if config.ENABLE_CUDASIM else 256  # the simulator runs a Python thread per GPU thread


@cuda.jit
def _flag_nonfinite(x, flag):
    i = cuda.grid(1)
    if i < x.size and not math.isfinite(x[i]):
        flag[0] = 1


def _nonfinite_slow(x: GpuArray) -> bool:
    if not x.size:
        return False
    flag = cuda.to_device(np.zeros(1, dtype=np.int32))
    _flag_nonfinite[-(-x.size // _SLOW_THREADS), _SLOW_THREADS](x.flat, flag)
    return bool(flag.copy_to_host()[0])
