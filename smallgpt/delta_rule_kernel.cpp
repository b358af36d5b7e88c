// The gated delta rule on a CPU, forward and backward, one (batch, head) a task
// (smallgpt/delta_rule_kernel.py builds it and registers it as the op smallgpt::delta_rule).
//
// Per head a state S (d_k x d_v) that each token decays, corrects and reads, as
// smallgpt/delta_rule.py's `recurrent` writes it:
//
//     D_t = diag(a_t) S_{t-1},  u_t = b_t (v_t - D_t^T k_t),  S_t = D_t + k_t u_t^T,  o_t = S_t^T q_t
//
// with a_t = exp(g_t): one decay a head (g of d_g = 1 channel, Gated DeltaNet) or one a channel of
// the key (d_g = d_k, Kimi Delta Attention). Token by token: at these head sizes the state stays in
// L1 and each step is two passes over it, which beats the chunked form's many small products.
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

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// The pointers and sizes of one (batch, head): q, k (T, d_k), v (T, d_v), g (T, d_g), b (T).
template <typename scalar_t>
struct Head {
    const scalar_t* q;
    const scalar_t* k;
    const scalar_t* v;
    const scalar_t* g;
    const scalar_t* b;
    int64_t T;
    int64_t d_k;
    int64_t d_v;
    int64_t d_g;
};

// One step of the rule on S in place (d_k x d_v, row i a channel of the key): S <- D + k u^T.
// Writes u (d_v), v - D^T k (d_v, the correction before its strength) and, where o is given, S^T q.
template <typename scalar_t>
inline void step(const Head<scalar_t>& h, int64_t t, scalar_t* S, scalar_t* u, scalar_t* miss,
                 scalar_t* o) {
    const int64_t d_k = h.d_k;
    const int64_t d_v = h.d_v;
    const scalar_t* k = h.k + t * d_k;
    const scalar_t* g = h.g + t * h.d_g;
    // decay each row and read the prediction D^T k in the same pass
    std::fill(miss, miss + d_v, scalar_t(0));
    for (int64_t i = 0; i < d_k; ++i) {
        const scalar_t a = std::exp(g[h.d_g == 1 ? 0 : i]);
        const scalar_t ki = k[i];
        scalar_t* Si = S + i * d_v;
#pragma omp simd
        for (int64_t j = 0; j < d_v; ++j) {
            Si[j] *= a;
            miss[j] += ki * Si[j];
        }
    }
    // the part of v the state does not predict, and the correction written along k
    const scalar_t* v = h.v + t * d_v;
    const scalar_t b = h.b[t];
#pragma omp simd
    for (int64_t j = 0; j < d_v; ++j) {
        miss[j] = v[j] - miss[j];
        u[j] = b * miss[j];
    }
    // write it, and read the new state with q
    const scalar_t* q = h.q + t * d_k;
    if (o != nullptr) {
        std::fill(o, o + d_v, scalar_t(0));
    }
    for (int64_t i = 0; i < d_k; ++i) {
        const scalar_t ki = k[i];
        const scalar_t qi = q[i];
        scalar_t* Si = S + i * d_v;
        if (o != nullptr) {
#pragma omp simd
            for (int64_t j = 0; j < d_v; ++j) {
                Si[j] += ki * u[j];
                o[j] += qi * Si[j];
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < d_v; ++j) {
                Si[j] += ki * u[j];
            }
        }
    }
}

template <typename scalar_t>
void forward_head(const Head<scalar_t>& h, const scalar_t* state, scalar_t* out, scalar_t* final_state,
                  scalar_t* checkpoints, int64_t chunk) {
    const int64_t size = h.d_k * h.d_v;
    std::vector<scalar_t> S(state, state + size);
    std::vector<scalar_t> u(h.d_v);
    std::vector<scalar_t> miss(h.d_v);
    for (int64_t t = 0; t < h.T; ++t) {
        if (t % chunk == 0) {  // the state before this chunk's first token
            std::copy(S.begin(), S.end(), checkpoints + (t / chunk) * size);
        }
        step(h, t, S.data(), u.data(), miss.data(), out + t * h.d_v);
    }
    std::copy(S.begin(), S.end(), final_state);
}

template <typename scalar_t>
void backward_head(const Head<scalar_t>& h, const scalar_t* checkpoints, const scalar_t* d_out,
                   const scalar_t* d_final, int64_t chunk, scalar_t* dq, scalar_t* dk, scalar_t* dv,
                   scalar_t* dg, scalar_t* db, scalar_t* d_state) {
    const int64_t d_k = h.d_k;
    const int64_t d_v = h.d_v;
    const int64_t size = d_k * d_v;
    // G: the loss's gradient by the state after the step at hand, from the final state's
    std::vector<scalar_t> G(d_final, d_final + size);
    // a chunk's states (the one before it first), corrections and misses, recomputed
    std::vector<scalar_t> states((chunk + 1) * size);
    std::vector<scalar_t> us(chunk * d_v);
    std::vector<scalar_t> misses(chunk * d_v);
    std::vector<scalar_t> du(d_v);
    std::vector<scalar_t> dp(d_v);
    std::vector<scalar_t> dgi(d_k);
    const int64_t n = (h.T + chunk - 1) / chunk;
    for (int64_t c = n - 1; c >= 0; --c) {
        const int64_t t0 = c * chunk;
        const int64_t len = std::min(chunk, h.T - t0);
        // recompute the chunk forward from its checkpoint
        std::copy(checkpoints + c * size, checkpoints + (c + 1) * size, states.begin());
        for (int64_t m = 0; m < len; ++m) {
            scalar_t* next = states.data() + (m + 1) * size;
            std::copy(states.data() + m * size, states.data() + (m + 1) * size, next);
            step(h, t0 + m, next, us.data() + m * d_v, misses.data() + m * d_v,
                 static_cast<scalar_t*>(nullptr));
        }
        // then back through it, last token first
        for (int64_t m = len - 1; m >= 0; --m) {
            const int64_t t = t0 + m;
            const scalar_t* before = states.data() + m * size;  // S_{t-1}
            const scalar_t* after = states.data() + (m + 1) * size;  // S_t
            const scalar_t* u = us.data() + m * d_v;
            const scalar_t* miss = misses.data() + m * d_v;
            const scalar_t* q = h.q + t * d_k;
            const scalar_t* k = h.k + t * d_k;
            const scalar_t* g = h.g + t * h.d_g;
            const scalar_t* do_t = d_out + t * d_v;
            const scalar_t b = h.b[t];
            scalar_t* dq_t = dq + t * d_k;
            scalar_t* dk_t = dk + t * d_k;
            // the read: G += q do^T, dq = S_t do; the write: dk = G u, du = G^T k
            std::fill(du.begin(), du.end(), scalar_t(0));
            for (int64_t i = 0; i < d_k; ++i) {
                const scalar_t qi = q[i];
                const scalar_t ki = k[i];
                scalar_t* Gi = G.data() + i * d_v;
                const scalar_t* Si = after + i * d_v;
                scalar_t dqi = 0;
                scalar_t dki = 0;
#pragma omp simd reduction(+ : dqi, dki)
                for (int64_t j = 0; j < d_v; ++j) {
                    dqi += Si[j] * do_t[j];
                    Gi[j] += qi * do_t[j];
                    dki += Gi[j] * u[j];
                    du[j] += Gi[j] * ki;
                }
                dq_t[i] = dqi;
                dk_t[i] = dki;
            }
            // the correction: u = b (v - D^T k)
            scalar_t dbt = 0;
            scalar_t* dv_t = dv + t * d_v;
#pragma omp simd reduction(+ : dbt)
            for (int64_t j = 0; j < d_v; ++j) {
                dbt += du[j] * miss[j];
                dv_t[j] = b * du[j];
                dp[j] = -b * du[j];
            }
            db[t] = dbt;
            // the prediction and the decay: dD = G + k dp^T, dk += D dp, dg = <dD, D> a row,
            // G <- diag(a) dD
            scalar_t dg_head = 0;
            for (int64_t i = 0; i < d_k; ++i) {
                const scalar_t a = std::exp(g[h.d_g == 1 ? 0 : i]);
                const scalar_t ki = k[i];
                scalar_t* Gi = G.data() + i * d_v;
                const scalar_t* Si = before + i * d_v;
                scalar_t dki = 0;
                scalar_t dgr = 0;
#pragma omp simd reduction(+ : dki, dgr)
                for (int64_t j = 0; j < d_v; ++j) {
                    const scalar_t D = a * Si[j];
                    const scalar_t dD = Gi[j] + ki * dp[j];
                    dki += D * dp[j];
                    dgr += dD * D;
                    Gi[j] = a * dD;
                }
                dk_t[i] += dki;
                dgi[i] = dgr;
                dg_head += dgr;
            }
            if (h.d_g == 1) {
                dg[t] = dg_head;
            } else {
                std::copy(dgi.begin(), dgi.end(), dg + t * d_k);
            }
        }
    }
    std::copy(G.begin(), G.end(), d_state);
}

template <typename scalar_t>
Head<scalar_t> head_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& g, const torch::Tensor& b, int64_t bh) {
    const int64_t T = q.size(2);
    const int64_t d_k = q.size(3);
    const int64_t d_v = v.size(3);
    const int64_t d_g = g.size(3);
    return Head<scalar_t>{q.data_ptr<scalar_t>() + bh * T * d_k,
                          k.data_ptr<scalar_t>() + bh * T * d_k,
                          v.data_ptr<scalar_t>() + bh * T * d_v,
                          g.data_ptr<scalar_t>() + bh * T * d_g,
                          b.data_ptr<scalar_t>() + bh * T,
                          T,
                          d_k,
                          d_v,
                          d_g};
}

}  // namespace

// q, k (B, H, T, d_k), v (B, H, T, d_v), g (B, H, T, d_g), b (B, H, T), state (B, H, d_k, d_v),
// all contiguous and of one type: the outputs (B, H, T, d_v), the final state and the checkpoints
// (B, H, ceil(T / chunk), d_k, d_v).
std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor g, torch::Tensor b, torch::Tensor state,
                                   int64_t chunk) {
    const int64_t B = q.size(0);
    const int64_t H = q.size(1);
    const int64_t T = q.size(2);
    const int64_t d_k = q.size(3);
    const int64_t d_v = v.size(3);
    const int64_t n = (T + chunk - 1) / chunk;
    auto out = torch::empty({B, H, T, d_v}, q.options());
    auto final_state = torch::empty({B, H, d_k, d_v}, q.options());
    auto checkpoints = torch::empty({B, H, n, d_k, d_v}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "delta_rule_forward", [&] {
        at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
            for (int64_t bh = begin; bh < end; ++bh) {
                auto h = head_of<scalar_t>(q, k, v, g, b, bh);
                forward_head<scalar_t>(h, state.data_ptr<scalar_t>() + bh * d_k * d_v,
                                       out.data_ptr<scalar_t>() + bh * T * d_v,
                                       final_state.data_ptr<scalar_t>() + bh * d_k * d_v,
                                       checkpoints.data_ptr<scalar_t>() + bh * n * d_k * d_v, chunk);
            }
        });
    });
    return {out, final_state, checkpoints};
}

// The gradients of q, k, v, g, b and the initial state, from those of the outputs and the final
// state (the inputs as forward took them, and its checkpoints).
std::vector<torch::Tensor> backward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    torch::Tensor g, torch::Tensor b, torch::Tensor checkpoints,
                                    torch::Tensor d_out, torch::Tensor d_final, int64_t chunk) {
    const int64_t B = q.size(0);
    const int64_t H = q.size(1);
    const int64_t T = q.size(2);
    const int64_t d_k = q.size(3);
    const int64_t d_v = v.size(3);
    const int64_t n = checkpoints.size(2);
    // contiguous, whatever strides a size-1 dimension of an input has (the fake does the same)
    auto dq = torch::empty(q.sizes(), q.options());
    auto dk = torch::empty(k.sizes(), k.options());
    auto dv = torch::empty(v.sizes(), v.options());
    auto dg = torch::empty(g.sizes(), g.options());
    auto db = torch::empty(b.sizes(), b.options());
    auto d_state = torch::empty({B, H, d_k, d_v}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "delta_rule_backward", [&] {
        at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
            for (int64_t bh = begin; bh < end; ++bh) {
                auto h = head_of<scalar_t>(q, k, v, g, b, bh);
                backward_head<scalar_t>(
                    h, checkpoints.data_ptr<scalar_t>() + bh * n * d_k * d_v,
                    d_out.data_ptr<scalar_t>() + bh * T * d_v,
                    d_final.data_ptr<scalar_t>() + bh * d_k * d_v, chunk,
                    dq.data_ptr<scalar_t>() + bh * T * d_k, dk.data_ptr<scalar_t>() + bh * T * d_k,
                    dv.data_ptr<scalar_t>() + bh * T * d_v, dg.data_ptr<scalar_t>() + bh * T * h.d_g,
                    db.data_ptr<scalar_t>() + bh * T, d_state.data_ptr<scalar_t>() + bh * d_k * d_v);
            }
        });
    });
    return {dq, dk, dv, dg, db, d_state};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &forward, "the gated delta rule, forward (smallgpt/delta_rule_kernel.py)");
    m.def("backward", &backward, "the gated delta rule, backward (smallgpt/delta_rule_kernel.py)");
}
