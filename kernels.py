"""
kernels.py: the expensive sequence operations of mecheval's mixers, each as a plain reference (the
definition you learn from) beside a fast form that gives the same outputs and gradients.

Layouts are (B, L, C), as in the mixers. All are differentiable: plain autograd, except the Toeplitz
convolution, whose backward is written out. mecheval.py --compile compiles them. test_mecheval.py tests each
fast form against its reference, and `python test_mecheval.py kernels` times the two.
"""
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

# ----------------------------------------------------------------------------------------------------
# Short causal depthwise convolution: y[:, t, c] = b[c] + Σ_i w[c, i] · x[:, t-(k-1)+i, c], x[<0] = 0.
# w[c, k-1] multiplies the current token (PyTorch Conv1d orientation).

def short_conv_ref(x, w, b=None):
    """x (B, L, C), w (C, k), b (C,) or None -> (B, L, C)."""
    k, L = w.shape[1], x.shape[1]
    xp = F.pad(x, (0, 0, k - 1, 0))                   # (B, L+k-1, C), k-1 zeros in front
    y = sum(xp[:, i:i + L] * w[:, i] for i in range(k))
    return y if b is None else y + b


def short_conv(x, w, b=None):
    """The same as one depthwise F.conv1d (a group per channel) over the input padded with k-1 zeros."""
    k = w.shape[1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), w[:, None, :], b, groups=w.shape[0])  # (B, C, L)
    return y.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------
# Long causal convolution with a filter as long as the sequence: y[:, t, c] = Σ_{s<=t} h[c, s] u[:, t-s, c].

def long_conv_ref(u, h):
    """u (B, L, C), h (C, L') with L' >= L (cut to L taps) -> (B, L, C). One shifted copy per lag."""
    L = u.shape[1]
    y = torch.zeros_like(u)
    for s in range(L):
        y[:, s:] = y[:, s:] + h[:, s] * u[:, :L - s]
    return y


class _ToeplitzConv(torch.autograd.Function):
    """y[:, :, c] = T_c u[:, :, c] with the causal Toeplitz matrix T[c, t, s] = h[c, t-s], forward and
    backward written out as one batched matmul each over contiguous (C, L, .) operands, so that bmm
    never copies a channel's matrix on its own."""

    @staticmethod
    def forward(ctx, u, h):
        L = u.shape[1]
        # window t of [0]*(L-1) + h holds h[t-L+1 .. t]; flipped, it is row t of T (zero for s > t)
        T = F.pad(h[:, :L], (L - 1, 0)).unfold(1, L, 1).flip(-1).contiguous()   # (C, L, L)
        U = u.permute(2, 1, 0).contiguous()                                       # (C, L, B)
        ctx.save_for_backward(T, U)
        ctx.h_len = h.shape[1]
        return torch.bmm(T, U).permute(2, 1, 0).contiguous()                      # (B, L, C)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        T, U = ctx.saved_tensors
        C, L, _ = T.shape
        gY = gy.permute(2, 1, 0).contiguous()                                     # (C, L, B)
        gu = torch.bmm(T.transpose(1, 2), gY).permute(2, 1, 0)
        # ∂h[c, s] = Σ_t M[c, t, t-s], M = gY Uᵀ: the diagonals of M. In M padded with L zeros on the
        # left, (t, t-s) sits at t·(2L+1) + (L-s), so stepping t by 2L+1 walks a diagonal. The padded M is
        # a fresh tensor, so its storage starts at 0 (no storage_offset(), which torch.compile cannot trace).
        M = F.pad(torch.bmm(gY, U.transpose(1, 2)), (L, 0))                      # (C, L, 2L)
        diag = M.as_strided((C, L, L), (2 * L * L, 2 * L + 1, 1), 1)             # [c, t, L-1-s]
        gh = diag.sum(1).flip(-1)                                                 # (C, L)
        return gu, F.pad(gh, (0, ctx.h_len - L))


def long_conv(u, h):
    """Fast long convolution: up to L = 128 (every AR document, most ATR ones) by the causal Toeplitz
    matrix, beyond by the FFT of size 2L, whose zero-padding makes the circular convolution causal."""
    L = u.shape[1]
    if L <= 128:
        return _ToeplitzConv.apply(u, h)
    n = 2 * L
    U = torch.fft.rfft(u, n=n, dim=1)                    # (B, L+1, C)
    H = torch.fft.rfft(h[:, :L], n=n, dim=1)             # (C, L+1)
    return torch.fft.irfft(U * H.T, n=n, dim=1)[:, :L]


# ----------------------------------------------------------------------------------------------------
# Based: causal linear attention with the 2nd-order Taylor feature map (Arora et al. 2024),
#     φ(x) = [1, x / f^¼, vec(x xᵀ) / (√2 √f)],  so  φ(q)·φ(k) = 1 + s + s²/2,  s = q·k / √f.

def taylor_features(x):
    """x (..., f) -> (..., 1 + f + f²): the full outer product, duplicated off-diagonals included."""
    f = x.shape[-1]
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2) / (math.sqrt(2) * math.sqrt(f))
    return torch.cat([torch.ones_like(x[..., :1]), x / f ** 0.25, outer], dim=-1)


def based_attention_ref(q, k, v, eps=1e-12):
    """q, k (B, L, f), v (B, L, d) -> (B, L, d): y_t = Σ_{s<=t} A_ts v_s / Σ_{s<=t} A_ts, A = φ(q)φ(k)ᵀ."""
    A = taylor_features(q) @ taylor_features(k).transpose(1, 2)   # (B, L, L)
    A = A.tril()
    return (A @ v) / (A.sum(-1, keepdim=True) + eps)


def based_attention(q, k, v, eps=1e-12):
    """The same through the kernel identity, never building the 73-dim features."""
    s = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])          # (B, L, L)
    A = (1 + s + 0.5 * s * s).tril()
    return (A @ v) / (A.sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------------------
# H3's diagonal SSM kernel (S4D with the bilinear discretisation), per head h over N/2 complex modes n:
#     K[h, t] = 2 Re Σ_n C̃_n λ_n^t,   λ = (1 + ΔA/2) / (1 - ΔA/2),   C̃ = C B Δ / (1 - ΔA/2)

def ssm_kernel_ref(dt, A_re, A_im, B, C, L):
    """dt (H,); A = A_re + i A_im (H, N/2); B, C (H, N/2, 2) complex numbers as (real, imaginary) pairs, as the
    mixer stores them -> K (H, L) real, by complex powers λ^t."""
    A, B, C, dt = torch.complex(A_re, A_im), torch.view_as_complex(B), torch.view_as_complex(C), dt[:, None]
    lam, Ct = (1 + dt * A / 2) / (1 - dt * A / 2), C * B * dt / (1 - dt * A / 2)
    return 2 * (Ct[..., None] * lam[..., None] ** torch.arange(L, device=dt.device)).sum(1).real


def ssm_kernel(dt, A_re, A_im, B, C, L):
    """The same in real arithmetic (complex ops are slow on a CPU). With z = ΔA/2 = x + iy,
    log λ = log(1 + z) - log(1 - z) and C̃ = C B Δ (1 - z̄) / |1 - z|². The powers are a baby step, giant
    step: λ^t = λ^(s·i) λ^j with t = s·i + j and s = ⌈√L⌉, so two Vandermonde blocks of ~√L powers and one
    matmul replace the (H, N/2, L) block of the reference."""
    dt = dt[:, None]                                                    # (H, 1)
    x, y = dt * A_re / 2, dt * A_im / 2                                # (H, N/2)
    n_plus, n_minus = (1 + x) ** 2 + y ** 2, (1 - x) ** 2 + y ** 2    # |1 + z|², |1 - z|²
    log_mag = 0.5 * (torch.log(n_plus) - torch.log(n_minus))         # log |λ|
    angle = torch.atan2(y, 1 + x) + torch.atan2(y, 1 - x)            # arg λ (any branch: integer powers)
    (Br, Bi), (Cr, Ci) = B.unbind(-1), C.unbind(-1)
    cb_re, cb_im = Cr * Br - Ci * Bi, Cr * Bi + Ci * Br                # C B
    w = dt / n_minus
    cr, ci = (w * (cb_re * (1 - x) - cb_im * y))[..., None], (w * (cb_re * y + cb_im * (1 - x)))[..., None]
    s = math.ceil(math.sqrt(L))
    j, i = torch.arange(s, device=dt.device), s * torch.arange(-(-L // s), device=dt.device)

    def powers(e):  # λ^e = |λ|^e (cos eθ + i sin eθ), real and imaginary parts (H, N/2, len(e))
        mag, ang = torch.exp(log_mag[..., None] * e), angle[..., None] * e
        return mag * torch.cos(ang), mag * torch.sin(ang)
    (Pr, Pi), (Gr, Gi) = powers(j), powers(i)
    X = torch.cat([cr * Pr - ci * Pi, cr * Pi + ci * Pr], dim=1)     # C̃ λ^j, (H, N, s) as [re; im]
    G = torch.cat([Gr, -Gi], dim=1)                                   # λ^(s i), [re; -im]
    return 2 * torch.bmm(G.transpose(1, 2), X).flatten(1)[:, :L]      # Re Σ_n C̃ λ^(s i + j)


# ----------------------------------------------------------------------------------------------------
# Mamba-1 selective scan (Gu & Dao 2023), per channel c and state n, s_{-1} = 0:
#     s_t = exp(Δ_t A) ⊙ s_{t-1} + Δ_t B_t x_t,    y_t = C_t · s_t + D x_t

def selective_scan_ref(x, delta, A, B, C, D):
    """x, delta (B, L, E); A (E, N); B, C (B, L, N); D (E,) -> y (B, L, E). As in mamba-minimal."""
    dA = torch.exp(delta[..., None] * A)                        # (B, L, E, N)
    dBx = delta[..., None] * B[:, :, None, :] * x[..., None]    # (B, L, E, N)
    s = torch.zeros_like(dA[:, 0])
    ys = []
    for t in range(x.shape[1]):
        s = dA[:, t] * s + dBx[:, t]
        ys.append((s * C[:, t, None, :]).sum(-1))               # (B, E)
    return torch.stack(ys, dim=1) + x * D


def selective_scan(x, delta, A, B, C, D):
    """The same, a step at a time on (B, E, N) slices, so no (B, L, E, N) tensor is built, forward or backward. The
    loop walks unbind() slices (indexing dA[:, t] makes autograd allocate a full-size zero tensor per step)."""
    s, ys = x.new_zeros(x.shape[0], x.shape[2], A.shape[1]), []
    for d_t, dx_t, B_t, C_t in zip(delta.unbind(1), (delta * x).unbind(1), B.unbind(1), C.unbind(1)):
        s = torch.baddbmm(torch.exp(d_t[..., None] * A) * s, dx_t[..., None], B_t[:, None, :])  # + Δx ⊗ B
        ys.append(torch.bmm(s, C_t[..., None])[..., 0])                  # (B, E)
    return torch.stack(ys, dim=1) + x * D


def selective_scan_parallel(x, delta, A, B, C, D):
    """The same as a Hillis-Steele scan: ⌈log2 L⌉ rounds of whole-tensor ops (for a GPU; a CPU loops faster).
    The decays are products of exp(ΔA) <= 1, so a large Δ|A| underflows to 0 and nothing overflows."""
    a = torch.exp(delta[..., None] * A)                                  # (B, L, E, N)
    b = (delta * x)[..., None] * B[:, :, None, :]                       # (B, L, E, N)
    k = 1
    while k < x.shape[1]:  # each t folds in the pair k steps back (a = 1, b = 0 before the start): 2k steps
        b = b + a * F.pad(b[:, :-k], (0, 0, 0, 0, k, 0))
        if 2 * k < x.shape[1]:  # the last round's decays would be unused
            a = a * F.pad(a[:, :-k], (0, 0, 0, 0, k, 0), value=1.0)
        k *= 2
    return (b @ C[..., None])[..., 0] + x * D                            # y_t = C_t · s_t + D x_t


# ----------------------------------------------------------------------------------------------------
# DeltaNet's delta rule (Schlag et al. 2021; Yang et al. 2024), state S (d_k, d_v), S_0 = 0:
#     S_t = S_{t-1} + k_t u_tᵀ,  u_t = β_t (v_t - S_{t-1}ᵀ k_t),   o_t = S_tᵀ q_t

def delta_rule_ref(q, k, v, beta):
    """q, k (B, L, dk), v (B, L, dv), beta (B, L) -> o (B, L, dv). The token loop."""
    S = q.new_zeros(q.shape[0], q.shape[2], v.shape[2])
    out = []
    for t in range(q.shape[1]):
        kt, vt, qt, bt = k[:, t], v[:, t], q[:, t], beta[:, t, None]
        u = bt * (vt - torch.einsum("bkv,bk->bv", S, kt))
        S = S + kt[:, :, None] * u[:, None, :]
        out.append(torch.einsum("bkv,bk->bv", S, qt))
    return torch.stack(out, dim=1)


def delta_rule(q, k, v, beta, chunk=64):
    """The chunked WY/UT form. Inside a chunk with start state S0, the new values u solve
        (I + diag(β) tril(K Kᵀ, -1)) u = diag(β) (V - K S0),
    a unit lower-triangular system: u = U - W S0 with [U | W] solved once for all chunks. Then
        o = Q S0 + tril(Q Kᵀ) u,   S_next = S0 + Kᵀ u.
    Only the state update runs as a loop over chunks (one chunk covers an AR document)."""
    Bsz, L = k.shape[:2]
    chunk = min(chunk, L)  # a short sequence is one chunk of its own length, not padded to 64
    n = -(-L // chunk)
    pad = n * chunk - L  # zero keys, values and betas leave the state unchanged

    def chunks(t):
        return F.pad(t, (0, 0, 0, pad)).reshape(Bsz, n, chunk, t.shape[-1])
    q_, k_, v_ = chunks(q), chunks(k), chunks(v)
    b_ = F.pad(beta, (0, pad)).reshape(Bsz, n, chunk, 1)
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    M = eye + (b_ * (k_ @ k_.transpose(-1, -2))).tril(-1)                         # (B, n, C, C)
    UW = torch.linalg.solve_triangular(M, b_ * torch.cat([v_, k_], -1), upper=False, unitriangular=True)
    U, W = UW[..., :v.shape[-1]], UW[..., v.shape[-1]:]
    attn = (q_ @ k_.transpose(-1, -2)).tril()                                     # (B, n, C, C)
    S, out = None, []  # S = None: the zero state of the first chunk, skipped rather than multiplied
    for i in range(n):
        u = U[:, i] if S is None else U[:, i] - W[:, i] @ S                      # (B, C, dv)
        out.append(attn[:, i] @ u if S is None else q_[:, i] @ S + attn[:, i] @ u)
        if i < n - 1:
            S = k_[:, i].transpose(1, 2) @ u if S is None else S + k_[:, i].transpose(1, 2) @ u
    return torch.cat(out, dim=1)[:, :L]
