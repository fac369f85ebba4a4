/* fairseq's Adam step of an fp32 master from a bf16 gradient, writing the bf16 weight, in one pass over memory
 * (CPU). cpu_adam.py compiles this file at first use, calls it through ctypes, and holds its PyTorch reference
 * (the same arithmetic in torch's ops, one op at a time): read that docstring first.
 *
 * Per element, in float32, in the order of torch's ops in fairseq.optim.adam.Adam.step after FP16Optimizer's unscale
 * (torch may fuse a multiply-add in add_(x, alpha=a); this file does not, so the two differ by float rounding):
 *   g = float(grad) * grad_scale
 *   m = m * beta1 + (1 - beta1) * g;  v = v * beta2 + (1 - beta2) * g * g
 *   p = p + (-lr * weight_decay) * p           (only where weight_decay != 0, as fairseq skips it)
 *   p = p + (-step_size) * m / (sqrt(v) + eps)
 *   weight = bf16(p), rounded to nearest even (torch's conversion; a NaN becomes 0x7fc0,
 *                                           where torch's vector path may give 0xffff: both are NaN)
 * Built with -ffp-contract=off: every operation is rounded as written, on any CPU (no fused multiply-add), so a
 * rank's result does not depend on which vector unit it ran on. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float *master;
    uint16_t *weight;
    const uint16_t *grad;
    float *exp_avg;
    float *exp_avg_sq;
    int64_t begin, end;
    float grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, step_size, eps;
    int has_decay;
} fm_job;

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

static void fm_run(const fm_job *j) {
    float *restrict p = j->master;
    uint16_t *restrict w = j->weight;
    const uint16_t *restrict gr = j->grad;
    float *restrict m = j->exp_avg;
    float *restrict v = j->exp_avg_sq;
    const float scale = j->grad_scale, b1 = j->beta1, c1 = j->one_minus_beta1, b2 = j->beta2,
                c2 = j->one_minus_beta2, decay = j->decay, step = j->step_size, eps = j->eps;
    const int has_decay = j->has_decay;
    for (int64_t i = j->begin; i < j->end; i++) {
        float g = bf16_to_float(gr[i]) * scale;
        float mi = m[i] * b1 + c1 * g;
        float vi = v[i] * b2 + c2 * g * g;
        float pi = p[i];
        if (has_decay) {
            pi = pi + decay * pi;
        }
        pi = pi + step * mi / (sqrtf(vi) + eps);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        w[i] = float_to_bf16(pi);
    }
}

static void *fm_thread(void *job) {
    fm_run((const fm_job *)job);
    return NULL;
}

#define FM_MAX_THREADS 256
#define FM_MIN_PER_THREAD 65536 /* elements: below this, a thread costs more than it saves */

/* Steps the n elements in `threads` chunks at most (fewer where a chunk would be under FM_MIN_PER_THREAD), one on
 * the calling thread; a chunk whose thread cannot start runs on the calling thread too. Returns the chunks. */
int fm_adam_bf16(float *master, uint16_t *weight, const uint16_t *grad, float *exp_avg, float *exp_avg_sq,
                 int64_t n, float grad_scale, float beta1, float one_minus_beta1, float beta2,
                 float one_minus_beta2, float decay, int has_decay, float step_size, float eps, int threads) {
    fm_job jobs[FM_MAX_THREADS];
    pthread_t ids[FM_MAX_THREADS];
    int started[FM_MAX_THREADS];
    int64_t most = n / FM_MIN_PER_THREAD > 0 ? n / FM_MIN_PER_THREAD : 1;
    if (threads > FM_MAX_THREADS) threads = FM_MAX_THREADS;
    if (threads > most) threads = (int)most;
    if (threads < 1) threads = 1;
    int64_t chunk = (n + threads - 1) / threads;
    chunk = (chunk + 63) / 64 * 64; /* whole cache lines of fp32 per thread */
    for (int t = 0; t < threads; t++) {
        fm_job j = {master, weight, grad, exp_avg, exp_avg_sq, 0, 0, grad_scale, beta1, one_minus_beta1, beta2,
                    one_minus_beta2, decay, step_size, eps, has_decay};
        j.begin = t * chunk < n ? t * chunk : n;
        j.end = (t + 1) * chunk < n ? (t + 1) * chunk : n;
        jobs[t] = j;
        started[t] = 0;
    }
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&ids[t], NULL, fm_thread, &jobs[t]) == 0;
    }
    fm_run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
        } else {
            fm_run(&jobs[t]);
        }
    }
    return threads;
}
