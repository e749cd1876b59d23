"""The source rewriting that lets g++ take the NVRTC source: same lines, only __shared__ declarations changed."""

import pytest

from cuflash.simt import _source

SRC = r'''// a comment naming __shared__ float nothing[1];
#define SMEM_DECL __shared__
namespace cuflash {
struct Tile { float x; };
template <int N>
__global__ void __launch_bounds__(128) k(float* out) {
  const char* s = "__shared__ in a string";
  __shared__ __align__(16) float a[N][4], b[N];
  static __shared__ Tile t
      [2];
  extern __shared__ __align__(16) unsigned char
      smem[];
  /* __shared__ int c[3]; */
  out[0] = a[0][0] + b[0] + t[0].x + smem[0] + s[0];
}
}  // namespace cuflash
extern "C" __global__ void plain(int* p) { __shared__ int q[2]; p[0] = q[0]; }
extern "C" {
__global__ void inside_block(int* p) { p[0] = 1; }
template <int N> __global__ void templated(int* p) { p[0] = N; }
}
__global__ void not_extern_c(int* p) { p[0] = 2; }
'''


def test_rewrite_keeps_every_line_in_place():
    out, kernels = _source.rewrite(SRC)
    assert out.count("\n") == SRC.count("\n")
    src_lines, out_lines = SRC.splitlines(), out.splitlines()
    for i, (a, b) in enumerate(zip(src_lines, out_lines)):
        if "__shared__" not in a and "smem[]" not in a and "[2];" not in a:
            assert a == b, (i + 1, a, b)
    assert kernels == ["plain", "inside_block"]


def test_static_shared_declarations_become_per_block_and_poisoned():
    out, _ = _source.rewrite(SRC)
    line = out.splitlines()[7]
    assert line.startswith("  CUFLASH_SIMT_SHARED __align__(16) float a[N][4], b[N];")
    assert "shared_fresh(&a, sizeof(a), __FILE__, 8);" in line and "shared_fresh(&b, sizeof(b), __FILE__, 8);" in line
    assert "static __shared__" not in out and "CUFLASH_SIMT_SHARED Tile t" in out
    assert "shared_fresh(&t, sizeof(t), __FILE__, 9);" in out.splitlines()[9]
    assert "shared_fresh(&q, sizeof(q), __FILE__, 17);" in out


def test_extern_shared_becomes_the_dynamic_buffer():
    out, _ = _source.rewrite(SRC)
    assert ("unsigned char* const smem = reinterpret_cast<unsigned char*>(::cuflash_simt::dynamic_shared());"
            in out.splitlines()[10])
    assert out.splitlines()[11] == ""  # the declaration's second line, emptied


def test_comments_strings_and_macros_are_left_alone():
    out, _ = _source.rewrite(SRC)
    lines = out.splitlines()
    assert lines[0] == SRC.splitlines()[0] and lines[1] == "#define SMEM_DECL __shared__"
    assert '"__shared__ in a string"' in lines[6] and "/* __shared__ int c[3]; */" in lines[12]


def test_namespace_scope_extern_shared_is_refused():
    with pytest.raises(_source.SourceError, match="kernel.cu:2: extern __shared__ at namespace scope"):
        _source.rewrite('namespace x {\nextern __shared__ float smem[];\n}\n')


def test_mask_blanks_comments_and_literals_only():
    src = 'a = "x//y"; // c\nb = \'"\'; /* d\n e */ f = 1\'000;'
    m = _source.mask(src)
    assert len(m) == len(src) and m.count("\n") == 2
    assert m.startswith('a = "    ";') and "f = 1'000;" in m and "c" not in m.split("\n")[0][12:]
