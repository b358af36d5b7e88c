// The gated delta rule on a CPU, forward and backward, one (batch, head) a task
// (smallgpt/delta_rule_kernel.py builds it and registers it as the op smallgpt::delta_rule).
//
// Per head a state S (d_k x d_v) that each token decays, corrects and reads, as
// smallgpt/delta_rule.py's `recurrent` writes it:
//
//     D_t = diag(a_t) S_{t-1},   u_t = b_t (v_t - D_t^T k_t),   S_t = D_t + k_t u_t^T,
//     o_t = S_t^T q_t
//
// with a_t = exp(g_t) (the functions here take a, and return dL/dg = a dL/da): one decay a head
// (d_g = 1 channel, Gated DeltaNet) or one a channel of
// the key (d_g = d_k, Kimi Delta Attention). Token by token: at these head sizes the state stays in
// L1, and each token is one pass over it forward (a token's write is applied in the next token's
// pass) and two backward (the chunk's recomputation, then one pass that steps back over a token's
// decay and the earlier token's read and write), which beats the chunked form's many small
// products.
//
// The forward keeps the state before every CHUNK-th token (O(T / CHUNK x d_k x d_v) a head). The
// backward goes over the chunks last to first, recomputes a chunk's states from its checkpoint into
// a buffer, and steps back through them with G = dL/dS_t (never stepping the state backwards:
// 1 / a_t overflows and I - b k k^T is singular as b -> 1):
//
//     G      += q_t do_t^T                    dq_t = S_t do_t
//     du      = G^T k_t                       dk_t = G u_t + D_t dp
//     dv_t    = b_t du,  dp = -b_t du,        db_t = du . (v_t - D_t^T k_t)
//     dD      = G + k_t dp^T                  dg_t = sum over the state's columns of dD * D_t
//     G       = diag(a_t) dD                  (dL/dS_{t-1})
//
// The state and every sum are in the inputs' type: float (the wrapper casts bf16 to it) or double
// (the oracle tests).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// q, k (T, d_k), v (T, d_v), g (T, d_g) and b (T) of one (batch, head), or their gradients: each
// a pointer to its token 0 and the step between its tokens. A token's features are contiguous,
// its tokens need not be: the layers hand in views of their (B, T, H, d) products, which a copy
// into (B, H, T, d) would cost a pass over each (docs/performance-cpu.md).
template <typename T>
struct Rows {
    T* q;
    T* k;
    T* v;
    T* g;
    T* b;
    int64_t q_step;
    int64_t k_step;
    int64_t v_step;
    int64_t g_step;
    int64_t b_step;

    T* q_at(int64_t t) const { return q + t * q_step; }
    T* k_at(int64_t t) const { return k + t * k_step; }
    T* v_at(int64_t t) const { return v + t * v_step; }
    T* g_at(int64_t t) const { return g + t * g_step; }
    T& b_at(int64_t t) const { return b[t * b_step]; }
};

// The inputs of one (batch, head) and its sizes.
template <typename scalar_t>
struct Head : Rows<const scalar_t> {
    int64_t T;
    int64_t d_k;
    int64_t d_v;
    int64_t d_g;
};

// A (T, d) matrix of one (batch, head), its tokens `step` apart: the outputs or their gradients.
template <typename T>
struct Tokens {
    T* data;
    int64_t step;

    T* at(int64_t t) const { return data + t * step; }
};

// The decay of key channel i at token t, a_t = exp(g_t) (given: torch exponentiates them
// vectorised, where an exp a channel and token here cost as much as the rest): a head's one
// decay, or the channel's own.
template <typename scalar_t>
inline scalar_t decay_at(const Head<scalar_t>& h, int64_t t, int64_t i) {
    return h.g_at(t)[h.d_g == 1 ? 0 : i];
}

// One pass over S (d_k x d_v) for token t, the write of the token before still pending in S
// (S + k_prev u_prev^T is the state S_{t-1}): applies that write, keeps S_{t-1} in `before` (if
// given), decays (S <- D_t) and sums D_t^T k and D_t^T q. Then u_t = b (v - D^T k), `miss` = v -
// D^T k, and where `o` is given, o_t = S_t^T q = D^T q + (k . q) u_t. The write of u_t is left
// pending (k_prev <- k_t, u_prev <- u_t): one pass a token, where the write, the decay and the
// reads would be two.
template <typename scalar_t, int DV>
inline void step(const Head<scalar_t>& h, int64_t t, scalar_t* S, const scalar_t* k_prev,
                 scalar_t* u_prev, scalar_t* before, scalar_t* miss, scalar_t* read, scalar_t* o) {
    // the state's sides: constants where forward()/backward() dispatched a square state's size
    const int64_t d_v = DV > 0 ? DV : h.d_v;
    const int64_t d_k = DV > 0 ? DV : h.d_k;
    
    const scalar_t* k = h.k_at(t);
    const scalar_t* q = h.q_at(t);
    std::fill(miss, miss + d_v, scalar_t(0));
    std::fill(read, read + d_v, scalar_t(0));
    scalar_t kq = 0;
    for (int64_t i = 0; i < d_k; ++i) {
        const scalar_t a = decay_at(h, t, i);
        const scalar_t kp = k_prev[i];
        const scalar_t ki = k[i];
        const scalar_t qi = q[i];
        scalar_t* Si = S + i * d_v;
        scalar_t* Bi = before == nullptr ? nullptr : before + i * d_v;
        kq += ki * qi;
#pragma omp simd
        for (int64_t j = 0; j < d_v; ++j) {
            const scalar_t was = Si[j] + kp * u_prev[j];
            if (Bi != nullptr) {
                Bi[j] = was;
            }
            const scalar_t D = a * was;
            Si[j] = D;
            miss[j] += ki * D;
            read[j] += qi * D;
        }
    }
    const scalar_t* v = h.v_at(t);
    const scalar_t b = h.b_at(t);
#pragma omp simd
    for (int64_t j = 0; j < d_v; ++j) {
        miss[j] = v[j] - miss[j];
        u_prev[j] = b * miss[j];
    }
    if (o != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < d_v; ++j) {
            o[j] = read[j] + kq * u_prev[j];
        }
    }
}

// The pending write applied: S <- S + k u^T (into `into`, S itself where it is S).
template <typename scalar_t>
inline void apply_write(const scalar_t* S, const scalar_t* k, const scalar_t* u, int64_t d_k,
                        int64_t d_v, scalar_t* into) {
    for (int64_t i = 0; i < d_k; ++i) {
#pragma omp simd
        for (int64_t j = 0; j < d_v; ++j) {
            into[i * d_v + j] = S[i * d_v + j] + k[i] * u[j];
        }
    }
}

template <typename scalar_t, int DV>
void forward_head(const Head<scalar_t>& h, const scalar_t* state, Tokens<scalar_t> out,
                  scalar_t* final_state, scalar_t* checkpoints, int64_t chunk) {
    // the state's sides: constants where forward()/backward() dispatched a square state's size
    const int64_t d_v = DV > 0 ? DV : h.d_v;
    const int64_t d_k = DV > 0 ? DV : h.d_k;
    const int64_t size = d_k * d_v;
    std::vector<scalar_t> S(state, state + size);
    std::vector<scalar_t> zeros(d_k, scalar_t(0));
    std::vector<scalar_t> u(d_v, scalar_t(0));
    std::vector<scalar_t> miss(d_v);
    std::vector<scalar_t> read(d_v);
    const scalar_t* k_prev = zeros.data();  // nothing pending before the first token
    for (int64_t t = 0; t < h.T; ++t) {
        if (t % chunk == 0) {  // the state before this chunk's first token, written whole
            apply_write(S.data(), k_prev, u.data(), d_k, d_v, S.data());
            k_prev = zeros.data();
            std::copy(S.begin(), S.end(), checkpoints + (t / chunk) * size);
        }
        scalar_t* no_before = nullptr;
        step<scalar_t, DV>(h, t, S.data(), k_prev, u.data(), no_before, miss.data(), read.data(),
                           out.at(t));
        k_prev = h.k_at(t);
    }
    apply_write(S.data(), k_prev, u.data(), d_k, d_v, final_state);
}

// The end of a token's read and write backward ("A" in backward_head, whose row-by-row pass gives
// du = G^T k): the correction's gradients, db = du . miss, dv = b du, and dp = -b du (into dp),
// which the token's prediction and decay ("B") read.
template <typename scalar_t, int DV>
inline void finish_correction(const Head<scalar_t>& h, int64_t t, const scalar_t* du,
                              const scalar_t* miss, const Rows<scalar_t>& d, scalar_t* dp) {
    // the state's sides: constants where forward()/backward() dispatched a square state's size
    const int64_t d_v = DV > 0 ? DV : h.d_v;
    const int64_t d_k = DV > 0 ? DV : h.d_k;
    const scalar_t b = h.b_at(t);
    scalar_t dbt = 0;
    scalar_t* dv_t = d.v_at(t);
#pragma omp simd reduction(+ : dbt)
    for (int64_t j = 0; j < d_v; ++j) {
        dbt += du[j] * miss[j];
        dv_t[j] = b * du[j];
        dp[j] = -b * du[j];
    }
    d.b_at(t) = dbt;
}

// The four sums over a row i of the state in the backward's fused pass (B of token t, A of
// token s = t - 1; backward_head) and its updates of G's row and du:
//
//     D = a S_s,  dD = G + k_t dp^T,  dkt = D . dp,  dgr = dD . D,     (B of t)
//     G <- a dD + q_s do_s^T,  dqs = S_s . do_s,  dks = G . u_s,  du += k_s G   (A of s)
template <typename scalar_t>
struct RowSums {
    scalar_t dkt;
    scalar_t dgr;
    scalar_t dqs;
    scalar_t dks;
};

#if defined(__AVX2__) && defined(__FMA__)
// The fused pass over every row of the state (fused_row, row after row) in 8-wide vectors: the
// rows' shared vectors (dp, do_s, u_s, and du's running sums) held in registers across the rows,
// and each row's four sums reduced together at its end. The compiler's form of fused_row's loop
// sums each one's eight lanes one after another (eight dependent adds and seven shuffles a sum,
// four sums a row: as many instructions as the row's own work). Writes dk_t (adding to it),
// dg_t (a head's one decay: the rows' sum), dq_s, dk_s and du.
template <int DV>
inline void fused_pass_avx(const float* a, int64_t d_g, const float* k_t, const float* q_s,
                           const float* k_s, const float* S_s, float* G, const float* dp,
                           const float* do_s, const float* u_s, float* du, float* dk_t,
                           float* dg_t, float* dq_s, float* dk_s) {
    constexpr int N = DV / 8;  // vectors a row
    __m256 dpv[N];
    __m256 dov[N];
    __m256 uv[N];
    __m256 duv[N];
    for (int n = 0; n < N; ++n) {
        dpv[n] = _mm256_loadu_ps(dp + 8 * n);
        dov[n] = _mm256_loadu_ps(do_s + 8 * n);
        uv[n] = _mm256_loadu_ps(u_s + 8 * n);
        duv[n] = _mm256_setzero_ps();
    }
    float dg_head = 0;
    for (int i = 0; i < DV; ++i) {
        const __m256 va = _mm256_set1_ps(a[d_g == 1 ? 0 : i]);
        const __m256 vkt = _mm256_set1_ps(k_t[i]);
        const __m256 vqs = _mm256_set1_ps(q_s[i]);
        const __m256 vks = _mm256_set1_ps(k_s[i]);
        const float* Si = S_s + i * DV;
        float* Gi = G + i * DV;
        __m256 dkt = _mm256_setzero_ps();
        __m256 dgr = _mm256_setzero_ps();
        __m256 dqs = _mm256_setzero_ps();
        __m256 dks = _mm256_setzero_ps();
        for (int n = 0; n < N; ++n) {
            const __m256 S = _mm256_loadu_ps(Si + 8 * n);
            const __m256 D = _mm256_mul_ps(va, S);
            const __m256 dD = _mm256_fmadd_ps(vkt, dpv[n], _mm256_loadu_ps(Gi + 8 * n));
            dkt = _mm256_fmadd_ps(D, dpv[n], dkt);
            dgr = _mm256_fmadd_ps(dD, D, dgr);
            const __m256 g_s = _mm256_fmadd_ps(va, dD, _mm256_mul_ps(vqs, dov[n]));
            _mm256_storeu_ps(Gi + 8 * n, g_s);
            dqs = _mm256_fmadd_ps(S, dov[n], dqs);
            dks = _mm256_fmadd_ps(g_s, uv[n], dks);
            duv[n] = _mm256_fmadd_ps(g_s, vks, duv[n]);
        }
        // lanes [0..3 | 4..7] of each sum pairwise (hadd), then again: [dkt, dgr, dqs, dks] of
        // each half, the halves added
        const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(dkt, dgr), _mm256_hadd_ps(dqs, dks));
        const __m128 sums =
            _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
        alignas(16) float out[4];
        _mm_store_ps(out, sums);
        dk_t[i] += out[0];
        if (d_g == 1) {
            dg_head += out[1];
        } else {
            dg_t[i] = out[1];
        }
        dq_s[i] = out[2];
        dk_s[i] = out[3];
    }
    for (int n = 0; n < N; ++n) {
        _mm256_storeu_ps(du + 8 * n, duv[n]);
    }
    if (d_g == 1) {
        dg_t[0] = dg_head;
    }
}
#endif

// The fused pass in AVX2 (fused_pass_avx) where it applies (float, a square state of a multiple
// of 8 a side): true where it ran, false where backward_head's row loop (fused_row) is to do it.
template <typename scalar_t, int DV>
inline bool fused_pass_vectorised(const scalar_t* a, int64_t d_g, const scalar_t* k_t,
                                  const scalar_t* q_s, const scalar_t* k_s, const scalar_t* S_s,
                                  scalar_t* G, const scalar_t* dp, const scalar_t* do_s,
                                  const scalar_t* u_s, scalar_t* du, scalar_t* dk_t,
                                  scalar_t* dg_t, scalar_t* dq_s, scalar_t* dk_s) {
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same<scalar_t, float>::value && DV > 0 && DV % 8 == 0) {
        fused_pass_avx<DV>(a, d_g, k_t, q_s, k_s, S_s, G, dp, do_s, u_s, du, dk_t, dg_t, dq_s,
                           dk_s);
        return true;
    }
#endif
    return false;
}

template <typename scalar_t, int DV>
inline RowSums<scalar_t> fused_row(int64_t d_v_, scalar_t a, scalar_t kt, scalar_t qs,
                                   scalar_t ks, const scalar_t* Si, scalar_t* Gi,
                                   const scalar_t* dp, const scalar_t* do_s, const scalar_t* u_s,
                                   scalar_t* du) {
    const int64_t d_v = DV > 0 ? DV : d_v_;
    scalar_t dkt = 0;
    scalar_t dgr = 0;
    scalar_t dqs = 0;
    scalar_t dks = 0;
#pragma omp simd reduction(+ : dkt, dgr, dqs, dks)
    for (int64_t j = 0; j < d_v; ++j) {
        // B(t): dD = G + k dp^T, dk += D dp, dg = <dD, D>, G <- a dD
        const scalar_t D = a * Si[j];
        const scalar_t dD = Gi[j] + kt * dp[j];
        dkt += D * dp[j];
        dgr += dD * D;
        // A(s): G += q do^T, dq = S_s do, dk = G u, du = G^T k
        const scalar_t g_s = a * dD + qs * do_s[j];
        Gi[j] = g_s;
        dqs += Si[j] * do_s[j];
        dks += g_s * u_s[j];
        du[j] += g_s * ks;
    }
    return {dkt, dgr, dqs, dks};
}

// backward_head's buffers, made once for all the heads a thread takes: made for each head, the
// chunk's states (260 KiB at 64 tokens of a 32 x 32 state) came from mmap whenever glibc's
// threshold for it stood low, and each backward then spent as long again in page faults (1.8 ->
// 3.3-4.4 ms at 64 x 24, in runs of calls; docs/performance-cpu.md).
template <typename scalar_t>
struct Scratch {
    Scratch(int64_t d_k, int64_t d_v, int64_t chunk)
        : G(d_k * d_v),
          states((chunk + 1) * d_k * d_v),
          us(chunk * d_v),
          misses(chunk * d_v),
          S(d_k * d_v),
          zeros(d_k, scalar_t(0)),
          u(d_v),
          read(d_v),
          du(d_v),
          dp(d_v),
          dp_next(d_v) {}
    std::vector<scalar_t> G;
    // a chunk's states recomputed (states[m]: before its m-th token; states[len]: after it), and
    // each token's correction u and miss v - D^T k
    std::vector<scalar_t> states;
    std::vector<scalar_t> us;
    std::vector<scalar_t> misses;
    std::vector<scalar_t> S;
    std::vector<scalar_t> zeros;  // k_prev before a chunk's first token: never written
    std::vector<scalar_t> u;
    std::vector<scalar_t> read;
    std::vector<scalar_t> du;
    std::vector<scalar_t> dp;  // dL/dp of the later token of a fused pass
    std::vector<scalar_t> dp_next;
};

template <typename scalar_t, int DV>
void backward_head(const Head<scalar_t>& h, const scalar_t* checkpoints,
                   Tokens<const scalar_t> d_out, const scalar_t* d_final, int64_t chunk,
                   const Rows<scalar_t>& d, scalar_t* d_state, Scratch<scalar_t>& scratch) {
    // the state's sides: constants where forward()/backward() dispatched a square state's size
    const int64_t d_v = DV > 0 ? DV : h.d_v;
    const int64_t d_k = DV > 0 ? DV : h.d_k;
    
    const int64_t size = d_k * d_v;
    // G: dL/dS after the token at hand, from the final state's
    std::vector<scalar_t>& G = scratch.G;
    std::copy(d_final, d_final + size, G.begin());
    std::vector<scalar_t>& states = scratch.states;
    std::vector<scalar_t>& us = scratch.us;
    std::vector<scalar_t>& misses = scratch.misses;
    std::vector<scalar_t>& S = scratch.S;
    const std::vector<scalar_t>& zeros = scratch.zeros;
    std::vector<scalar_t>& u = scratch.u;
    std::vector<scalar_t>& read = scratch.read;
    std::vector<scalar_t>& du = scratch.du;
    std::vector<scalar_t>& dp = scratch.dp;
    std::vector<scalar_t>& dp_next = scratch.dp_next;
    const int64_t n = (h.T + chunk - 1) / chunk;
    for (int64_t c = n - 1; c >= 0; --c) {
        const int64_t t0 = c * chunk;
        const int64_t len = std::min(chunk, h.T - t0);
        // recompute the chunk forward from its checkpoint, one pass a token
        std::copy(checkpoints + c * size, checkpoints + (c + 1) * size, S.begin());
        std::fill(u.begin(), u.end(), scalar_t(0));
        const scalar_t* k_prev = zeros.data();
        for (int64_t m = 0; m < len; ++m) {
            step<scalar_t, DV>(h, t0 + m, S.data(), k_prev, u.data(), states.data() + m * size,
                 misses.data() + m * d_v, read.data(), static_cast<scalar_t*>(nullptr));
            std::copy(u.begin(), u.end(), us.begin() + m * d_v);
            k_prev = h.k_at(t0 + m);
        }
        apply_write(S.data(), k_prev, u.data(), d_k, d_v, states.data() + len * size);
        // A of the chunk's last token alone: its read and write, with S_t the state after it
        int64_t s = t0 + len - 1;
        {
            const scalar_t* S_s = states.data() + len * size;
            const scalar_t* u_s = us.data() + (len - 1) * d_v;
            std::fill(du.begin(), du.end(), scalar_t(0));
            for (int64_t i = 0; i < d_k; ++i) {
                const scalar_t qi = h.q_at(s)[i];
                const scalar_t ki = h.k_at(s)[i];
                const scalar_t* do_s = d_out.at(s);
                scalar_t* Gi = G.data() + i * d_v;
                const scalar_t* Si = S_s + i * d_v;
                scalar_t dqi = 0;
                scalar_t dki = 0;
#pragma omp simd reduction(+ : dqi, dki)
                for (int64_t j = 0; j < d_v; ++j) {
                    dqi += Si[j] * do_s[j];
                    Gi[j] += qi * do_s[j];
                    dki += Gi[j] * u_s[j];
                    du[j] += Gi[j] * ki;
                }
                d.q_at(s)[i] = dqi;
                d.k_at(s)[i] = dki;
            }
            const scalar_t* miss_s = misses.data() + (len - 1) * d_v;
            finish_correction<scalar_t, DV>(h, s, du.data(), miss_s, d, dp.data());
        }
        // then one pass a token: B of token t (its prediction and decay) with A of token s = t - 1,
        // both reading S_{t-1} = S_s (states[m])
        for (int64_t m = len - 1; m >= 0; --m) {
            const int64_t t = t0 + m;
            s = t - 1;
            const bool fused = m > 0;  // the chunk's first token's A is the previous chunk's
            const scalar_t* S_s = states.data() + m * size;
            const scalar_t* u_s = fused ? us.data() + (m - 1) * d_v : nullptr;
            const scalar_t* do_s = fused ? d_out.at(s) : nullptr;
            std::fill(du.begin(), du.end(), scalar_t(0));
            const bool rows_done =
                fused && fused_pass_vectorised<scalar_t, DV>(
                             h.g_at(t), h.d_g, h.k_at(t), h.q_at(s), h.k_at(s), S_s, G.data(),
                             dp.data(), do_s, u_s, du.data(), d.k_at(t), d.g_at(t), d.q_at(s),
                             d.k_at(s));
            scalar_t dg_head = 0;
            for (int64_t i = 0; i < d_k && !rows_done; ++i) {
                const scalar_t a = decay_at(h, t, i);
                const scalar_t kt = h.k_at(t)[i];
                scalar_t* Gi = G.data() + i * d_v;
                const scalar_t* Si = S_s + i * d_v;
                scalar_t dkt = 0;
                scalar_t dgr = 0;
                if (fused) {
                    const auto sums = fused_row<scalar_t, DV>(
                        d_v, a, kt, h.q_at(s)[i], h.k_at(s)[i], Si, Gi, dp.data(), do_s, u_s,
                        du.data());
                    dkt = sums.dkt;
                    dgr = sums.dgr;
                    d.q_at(s)[i] = sums.dqs;
                    d.k_at(s)[i] = sums.dks;
                } else {
#pragma omp simd reduction(+ : dkt, dgr)
                    for (int64_t j = 0; j < d_v; ++j) {
                        const scalar_t D = a * Si[j];
                        const scalar_t dD = Gi[j] + kt * dp[j];
                        dkt += D * dp[j];
                        dgr += dD * D;
                        Gi[j] = a * dD;
                    }
                }
                d.k_at(t)[i] += dkt;
                if (h.d_g == 1) {
                    dg_head += dgr;
                } else {
                    d.g_at(t)[i] = dgr;
                }
            }
            if (h.d_g == 1 && !rows_done) {
                d.g_at(t)[0] = dg_head;
            }
            if (fused) {
                const scalar_t* miss_s = misses.data() + (m - 1) * d_v;
                finish_correction<scalar_t, DV>(h, s, du.data(), miss_s, d, dp_next.data());
                std::swap(dp, dp_next);
            }
        }
    }
    std::copy(G.begin(), G.end(), d_state);
}

// row (batch, head) bh of x (B, H, T, ...): its token 0, H heads a batch row
template <typename T>
T* row_of(const torch::Tensor& x, int64_t bh, int64_t H) {
    return static_cast<T*>(x.data_ptr()) + (bh / H) * x.stride(0) + (bh % H) * x.stride(1);
}

// q, k, v, g and b of (batch, head) bh, or their gradients (T: const or not)
template <typename T>
Rows<T> rows_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                const torch::Tensor& g, const torch::Tensor& b, int64_t bh) {
    const int64_t H = q.size(1);
    return Rows<T>{row_of<T>(q, bh, H), row_of<T>(k, bh, H), row_of<T>(v, bh, H),
                   row_of<T>(g, bh, H), row_of<T>(b, bh, H), q.stride(2), k.stride(2),
                   v.stride(2), g.stride(2), b.stride(2)};
}

template <typename scalar_t>
Head<scalar_t> head_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& g, const torch::Tensor& b, int64_t bh) {
    const int64_t d_g = g.size(3);  // 1: a decay a head
    return Head<scalar_t>{rows_of<const scalar_t>(q, k, v, g, b, bh), q.size(2), q.size(3),
                          v.size(3), d_g};
}

// f(std::integral_constant<int, W>) for a square state's side W where it is a common head size
// (its loops then unrolled), else with W = 0 (the sizes read at run time).
template <typename F>
inline void with_width(int64_t d_v, F f) {
    switch (d_v) {
        case 16:
            f(std::integral_constant<int, 16>{});
            break;
        case 32:
            f(std::integral_constant<int, 32>{});
            break;
        case 64:
            f(std::integral_constant<int, 64>{});
            break;
        case 128:
            f(std::integral_constant<int, 128>{});
            break;
        default:
            f(std::integral_constant<int, 0>{});
    }
}

// The layers' L2 norm of q and k, fused: each of x's T rows (`step` apart) over the root of its
// squares' sum plus 1e-6, times `scale`, into `into` (T x d, contiguous), what the kernel then reads
// as q or k. A pass over d floats a token where torch takes five over the whole tensor each way.
template <typename scalar_t>
void normalise_rows(const scalar_t* x, int64_t step, int64_t T, int64_t d, scalar_t scale,
                    scalar_t* into) {
    for (int64_t t = 0; t < T; ++t) {
        const scalar_t* row = x + t * step;
        scalar_t squares = 0;
#pragma omp simd reduction(+ : squares)
        for (int64_t j = 0; j < d; ++j) {
            squares += row[j] * row[j];
        }
        const scalar_t r = scale / std::sqrt(squares + scalar_t(1e-6));
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
            into[t * d + j] = row[j] * r;
        }
    }
}

// Back through normalise_rows, in place: dx's rows hold the gradients of the normalised rows and
// become those of x's, dx = scale r (dn - n (n . dn)), with r = 1 / sqrt(x . x + 1e-6) and
// n = x r (the derivative of x r is r (I - n n^T), the 1e-6 included).
template <typename scalar_t>
void normalise_rows_backward(const scalar_t* x, int64_t step, int64_t T, int64_t d,
                             scalar_t scale, scalar_t* dx, int64_t dx_step) {
    for (int64_t t = 0; t < T; ++t) {
        const scalar_t* row = x + t * step;
        scalar_t* grad = dx + t * dx_step;
        scalar_t squares = 0;
#pragma omp simd reduction(+ : squares)
        for (int64_t j = 0; j < d; ++j) {
            squares += row[j] * row[j];
        }
        const scalar_t r = scalar_t(1) / std::sqrt(squares + scalar_t(1e-6));
        scalar_t along = 0;  // n . dn
#pragma omp simd reduction(+ : along)
        for (int64_t j = 0; j < d; ++j) {
            along += row[j] * r * grad[j];
        }
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
            grad[j] = scale * r * (grad[j] - row[j] * r * along);
        }
    }
}

// Where the layer asks the kernel to normalise q and k (q_scale > 0), h's q and k read from their
// normalised rows (`qn`, `kn`, T x d_k a thread), else h unchanged.
template <typename scalar_t>
void read_normalised(Head<scalar_t>& h, double q_scale, std::vector<scalar_t>& qn,
                     std::vector<scalar_t>& kn) {
    if (q_scale <= 0) {
        return;
    }
    qn.resize(h.T * h.d_k);
    kn.resize(h.T * h.d_k);
    normalise_rows(h.q, h.q_step, h.T, h.d_k, static_cast<scalar_t>(q_scale), qn.data());
    normalise_rows(h.k, h.k_step, h.T, h.d_k, scalar_t(1), kn.data());
    h.q = qn.data();
    h.k = kn.data();
    h.q_step = h.d_k;
    h.k_step = h.d_k;
}

}  // namespace

// q, k (B, H, T, d_k), v (B, H, T, d_v), the decays a = exp(g) (B, H, T, d_g), b (B, H, T), of one
// type, each token's features contiguous (a token's rows may be apart: views of (B, T, H, d)),
// and the state (B, H, d_k, d_v), contiguous: the outputs (B, H, T, d_v), laid out (B, T, H,
// d_v) as the layers read them, the final state and the checkpoints (B, H, ceil(T / chunk), d_k,
// d_v). With q_scale > 0, q and k are the layer's rows before their L2 norm, which the kernel
// applies (normalise_rows), q then times q_scale.
std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor g, torch::Tensor b, torch::Tensor state,
                                   int64_t chunk, double q_scale) {
    const int64_t B = q.size(0);
    const int64_t H = q.size(1);
    const int64_t T = q.size(2);
    const int64_t d_k = q.size(3);
    const int64_t d_v = v.size(3);
    const int64_t size = d_k * d_v;
    const int64_t n = (T + chunk - 1) / chunk;
    auto out = torch::empty({B, T, H, d_v}, q.options()).transpose(1, 2);
    auto final_state = torch::empty({B, H, d_k, d_v}, q.options());
    auto checkpoints = torch::empty({B, H, n, d_k, d_v}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "delta_rule_forward", [&] {
        at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
            std::vector<scalar_t> qn;
            std::vector<scalar_t> kn;
            for (int64_t bh = begin; bh < end; ++bh) {
                auto h = head_of<scalar_t>(q, k, v, g, b, bh);
                read_normalised(h, q_scale, qn, kn);
                const scalar_t* state_bh = state.data_ptr<scalar_t>() + bh * size;
                Tokens<scalar_t> out_bh{row_of<scalar_t>(out, bh, H), out.stride(2)};
                scalar_t* final_bh = final_state.data_ptr<scalar_t>() + bh * size;
                scalar_t* checkpoints_bh = checkpoints.data_ptr<scalar_t>() + bh * n * size;
                with_width(d_k == d_v ? d_v : 0, [&](auto width) {
                    constexpr int W = decltype(width)::value;
                    forward_head<scalar_t, W>(h, state_bh, out_bh, final_bh, checkpoints_bh, chunk);
                });
            }
        });
    });
    return {out, final_state, checkpoints};
}

// The gradients of q, k, v, g (the log decays: dL/dg = a dL/da), b and the initial state, from
// those of the outputs (laid out as the inputs may be) and the final state (contiguous), the
// inputs as forward took them and its checkpoints. Each gradient is laid out as its input is
// (empty_like's rule: a view with gaps between its tokens gets a dense layout of the same order).
// With q_scale > 0 (forward's), the gradients of q and k are those of the rows before the norm.
std::vector<torch::Tensor> backward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    torch::Tensor g, torch::Tensor b, torch::Tensor checkpoints,
                                    torch::Tensor d_out, torch::Tensor d_final, int64_t chunk,
                                    double q_scale) {
    const int64_t B = q.size(0);
    const int64_t H = q.size(1);
    const int64_t d_k = q.size(3);
    const int64_t d_v = v.size(3);
    const int64_t size = d_k * d_v;
    const int64_t n = checkpoints.size(2);
    auto dq = torch::empty_like(q);
    auto dk = torch::empty_like(k);
    auto dv = torch::empty_like(v);
    auto dg = torch::empty_like(g);
    auto db = torch::empty_like(b);
    auto d_state = torch::empty({B, H, d_k, d_v}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "delta_rule_backward", [&] {
        at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
            Scratch<scalar_t> scratch(d_k, d_v, chunk);
            std::vector<scalar_t> qn;
            std::vector<scalar_t> kn;
            for (int64_t bh = begin; bh < end; ++bh) {
                const auto raw = head_of<scalar_t>(q, k, v, g, b, bh);
                auto h = raw;
                read_normalised(h, q_scale, qn, kn);
                auto d = rows_of<scalar_t>(dq, dk, dv, dg, db, bh);
                const scalar_t* checkpoints_bh = checkpoints.data_ptr<scalar_t>() + bh * n * size;
                Tokens<const scalar_t> d_out_bh{row_of<const scalar_t>(d_out, bh, H),
                                                d_out.stride(2)};
                const scalar_t* d_final_bh = d_final.data_ptr<scalar_t>() + bh * size;
                scalar_t* d_state_bh = d_state.data_ptr<scalar_t>() + bh * size;
                with_width(d_k == d_v ? d_v : 0, [&](auto width) {
                    constexpr int W = decltype(width)::value;
                    backward_head<scalar_t, W>(h, checkpoints_bh, d_out_bh, d_final_bh, chunk, d,
                                               d_state_bh, scratch);
                });
                if (q_scale > 0) {  // dq and dk of the normalised rows, back to the raw ones
                    normalise_rows_backward(raw.q, raw.q_step, raw.T, raw.d_k,
                                            static_cast<scalar_t>(q_scale), d.q, d.q_step);
                    normalise_rows_backward(raw.k, raw.k_step, raw.T, raw.d_k, scalar_t(1), d.k,
                                            d.k_step);
                }
            }
        });
    });
    return {dq, dk, dv, dg, db, d_state};
}

// The recurrent layers' short causal depthwise convolution (gated_deltanet.py's
// short_convolution, before its SiLU), over x (B, T, W) after `before` (B, K - 1, W), its last
// inputs, with taps (K, W): tap j of every channel contiguous, so the loops over the channels
// vectorise. Output t reads the inputs at t - (K - 1) .. t, the earliest of them through tap 0:
//
//     y_t = sum_j taps_j * in_{t + j - (K - 1)},   in_p = x_p (p >= 0), before_{K - 1 + p} (p < 0)
//
// One pass forward and one backward, where the torch path takes K products and K - 1 sums each
// way, every one a pass over (B, T, W) (the layer's costliest elementwise work, eager).

namespace {

// the input row at position p of batch row b: x's, or before's where p < 0 (or that row of
// their gradients: scalar_t is const or not)
template <typename scalar_t>
inline scalar_t* input_row(scalar_t* x, scalar_t* before, int64_t b, int64_t p, int64_t T,
                           int64_t K, int64_t W) {
    return p >= 0 ? x + (b * T + p) * W : before + (b * (K - 1) + K - 1 + p) * W;
}

// rows (b, t) of a task: this many a task, so that a long sequence of one batch row spreads
// over the threads as a batch of short ones does
constexpr int64_t ROWS = 64;

}  // namespace

// y (B, T, W): the convolution of x after `before` (all contiguous, of one type).
torch::Tensor convolve(torch::Tensor x, torch::Tensor before, torch::Tensor taps) {
    const int64_t B = x.size(0);
    const int64_t T = x.size(1);
    const int64_t W = x.size(2);
    const int64_t K = taps.size(0);
    auto y = torch::empty({B, T, W}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "convolve", [&] {
        const scalar_t* xs = x.data_ptr<scalar_t>();
        const scalar_t* bs = before.data_ptr<scalar_t>();
        const scalar_t* w = taps.data_ptr<scalar_t>();
        scalar_t* ys = y.data_ptr<scalar_t>();
        at::parallel_for(0, B * T, ROWS, [&](int64_t begin, int64_t end) {
            for (int64_t row = begin; row < end; ++row) {
                const int64_t b = row / T;
                const int64_t t = row % T;
                scalar_t* out = ys + row * W;
                const scalar_t* in = input_row(xs, bs, b, t - (K - 1), T, K, W);
                for (int64_t c = 0; c < W; ++c) out[c] = w[c] * in[c];
                for (int64_t j = 1; j < K; ++j) {
                    in = input_row(xs, bs, b, t + j - (K - 1), T, K, W);
                    const scalar_t* w_j = w + j * W;
                    for (int64_t c = 0; c < W; ++c) out[c] += w_j[c] * in[c];
                }
            }
        });
    });
    return y;
}

// The gradients of x, before and the taps from dy (B, T, W), the gradient of y. Input p reaches
// output t = p + K - 1 - j through tap j, so d in_p = sum_j taps_j * dy_{p + K - 1 - j} (the
// outputs that exist), and d taps_j = sum over (b, t) of dy_t * in_{t + j - (K - 1)}: summed by
// each task into its own row of `partial` (tasks, K, W), then over the tasks.
std::vector<torch::Tensor> convolve_backward(torch::Tensor x, torch::Tensor before,
                                             torch::Tensor taps, torch::Tensor dy) {
    const int64_t B = x.size(0);
    const int64_t T = x.size(1);
    const int64_t W = x.size(2);
    const int64_t K = taps.size(0);
    // an input position a row: before's K - 1, then x's T
    const int64_t P = K - 1 + T;
    const int64_t tasks = (B * P + ROWS - 1) / ROWS;
    auto dx = torch::empty({B, T, W}, x.options());
    auto d_before = torch::empty({B, K - 1, W}, x.options());
    auto partial = torch::zeros({tasks, K, W}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "convolve_backward", [&] {
        const scalar_t* xs = x.data_ptr<scalar_t>();
        const scalar_t* bs = before.data_ptr<scalar_t>();
        const scalar_t* w = taps.data_ptr<scalar_t>();
        const scalar_t* dys = dy.data_ptr<scalar_t>();
        scalar_t* dxs = dx.data_ptr<scalar_t>();
        scalar_t* d_befores = d_before.data_ptr<scalar_t>();
        scalar_t* parts = partial.data_ptr<scalar_t>();
        at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
            for (int64_t task = first; task < last; ++task) {
                scalar_t* d_taps = parts + task * K * W;
                const int64_t end = std::min(B * P, (task + 1) * ROWS);
                for (int64_t row = task * ROWS; row < end; ++row) {
                    const int64_t b = row / P;
                    const int64_t p = row % P - (K - 1);  // the input's position (< 0: before's)
                    const scalar_t* in = input_row(xs, bs, b, p, T, K, W);
                    // d in_p: the same row of dx, or of d_before (as input_row reads them)
                    scalar_t* out = input_row(dxs, d_befores, b, p, T, K, W);
                    std::fill(out, out + W, scalar_t(0));
                    for (int64_t j = 0; j < K; ++j) {
                        const int64_t t = p + K - 1 - j;
                        if (t < 0 || t >= T) continue;
                        const scalar_t* dy_t = dys + (b * T + t) * W;
                        const scalar_t* w_j = w + j * W;
                        scalar_t* d_j = d_taps + j * W;
                        for (int64_t c = 0; c < W; ++c) {
                            out[c] += w_j[c] * dy_t[c];
                            d_j[c] += dy_t[c] * in[c];
                        }
                    }
                }
            }
        });
    });
    return {dx, d_before, partial.sum(0)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &forward, "the gated delta rule, forward (smallgpt/delta_rule_kernel.py)");
    m.def("backward", &backward, "the gated delta rule, backward (smallgpt/delta_rule_kernel.py)");
    m.def("convolve", &convolve, "the short causal depthwise convolution, forward");
    m.def("convolve_backward", &convolve_backward, "the short causal depthwise convolution, backward");
}
