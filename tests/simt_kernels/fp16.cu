// Conversions and arithmetic of __half and __nv_bfloat16, element-wise over arrays (tests/simt/test_simt_fp16.py).
// Prepend common.cuh. Bits travel as unsigned short so the test sees exact patterns.

extern "C" __global__ void half_to_float(const unsigned short* h, float* f, const unsigned short* b, float* fb,
                                         int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  f[i] = __half2float(__ushort_as_half(h[i]));
  fb[i] = __bfloat162float(__ushort_as_bfloat16(b[i]));
}

extern "C" __global__ void float_to_half(const float* f, unsigned short* h, unsigned short* b, unsigned short* h2,
                                         unsigned short* b2, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  h[i] = __half_as_ushort(__float2half_rn(f[i]));
  b[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f[i]));
  // The paired conversions, on (f[i], -f[i]).
  __half2 hh = __floats2half2_rn(f[i], -f[i]);
  __nv_bfloat162 bb = __float22bfloat162_rn(make_float2(f[i], -f[i]));
  h2[2 * i] = __half_as_ushort(__low2half(hh));
  h2[2 * i + 1] = __half_as_ushort(__high2half(hh));
  b2[2 * i] = __bfloat16_as_ushort(__low2bfloat16(bb));
  b2[2 * i + 1] = __bfloat16_as_ushort(__high2bfloat16(bb));
}

extern "C" __global__ void double_to_half(const double* d, unsigned short* h, unsigned short* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  h[i] = __half_as_ushort(__double2half(d[i]));
  b[i] = __bfloat16_as_ushort(__double2bfloat16(d[i]));
}

// out[4 * i + k] = (x[i] op y[i]) for op in + - * /, as __half (H = 0) or __nv_bfloat16 (H = 1), via the operators.
template <int H>
__global__ void arithmetic(const unsigned short* x, const unsigned short* y, unsigned short* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (H == 0) {
    __half a = __ushort_as_half(x[i]), b = __ushort_as_half(y[i]);
    __half r[4] = {a + b, a - b, a * b, a / b};
    for (int k = 0; k < 4; k++) out[4 * i + k] = __half_as_ushort(r[k]);
  } else {
    __nv_bfloat16 a = __ushort_as_bfloat16(x[i]), b = __ushort_as_bfloat16(y[i]);
    __nv_bfloat16 r[4] = {__hadd(a, b), __hsub(a, b), __hmul(a, b), __hdiv(a, b)};
    for (int k = 0; k < 4; k++) out[4 * i + k] = __bfloat16_as_ushort(r[k]);
  }
}
