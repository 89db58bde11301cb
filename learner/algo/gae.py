"""Skip-observation token-level GAE, length-adaptive λ, and the step-level GAE ablation.

Source: SAO (arXiv 2607.07508) §2.4 "跳过环境 observation 的 token 级 GAE" (papers/001; papers/003
§二(二)3), the experimental setup for λ_policy (papers/003 §三(一)), and appendix A.1 for the
step-level variants (papers/001 §3.5); docs/design.md §5.3.

Alignment convention (shared with ``learner.algo.critic``): ``values[:, t] = V(s_t)``, the value of the
state *before* token t is generated. For action token t the TD residual is
``δ_t = r_t + γ V(s_next) − V(s_t)`` where ``s_next`` is the state before the *next action token*
of the same row (skipping any observation tokens in between), and ``V = 0`` after the row's last
action token.
"""

from __future__ import annotations

from typing import Literal

import torch

StepMode = Literal["mean", "last"]


def _check_2d(name: str, t: torch.Tensor, shape: torch.Size) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _lambda_per_row(lam: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    lam_t = torch.as_tensor(lam, dtype=torch.float32, device=device)
    if lam_t.dim() == 0:
        lam_t = lam_t.expand(batch)
    if lam_t.shape != (batch,):
        raise ValueError(f"lam must be a float or a [B]={batch} tensor, got shape {tuple(lam_t.shape)}")
    if bool(((lam_t < 0) | (lam_t > 1)).any()):
        raise ValueError("lam must lie in [0, 1]")
    return lam_t


def token_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation token GAE: standard GAE run on each row's action tokens only.

    Per row, the action tokens ``t_0 < t_1 < … < t_{L-1}`` (positions where the mask is 1) form the
    sequence; ``δ_j = r[t_j] + γ·V[t_{j+1}] − V[t_j]`` with ``V[t_L] := 0`` (terminal), and
    ``Â_j = δ_j + γ·λ·Â_{j+1}``. The last token of action i therefore bootstraps from the first token
    of action i+1 (SAO §2.4: ``Â(a_{i,N}) = δ + γλ Â(a_{i+1,0})``). Observation and padding positions
    get advantage 0 and return 0, and their values are never read. With ``lam = 1`` the return is
    the discounted Monte-Carlo return, independent of ``values`` (the critic's target, λ_critic = 1).

    Args:
        rewards: [B, T] float, per-token reward. Rewards must sit on action tokens (SAO's terminal
            reward goes on the last action token).
        values: [B, T] float, ``values[:, t] = V(s_t)`` (see module docstring).
        action_mask: [B, T] 0/1 float or bool.
        gamma: discount per action token, in [0, 1].
        lam: GAE λ in [0, 1], a float or a [B] tensor (one λ per row, e.g. length-adaptive).

    Returns:
        ``(advantages, returns)``, both [B, T] float32; ``returns = advantages + values`` on action
        tokens, 0 elsewhere.

    Raises:
        ValueError: shapes differ, γ or λ out of range, or a nonzero reward on a non-action position
            (it would otherwise be silently dropped).

    Cost: one backward loop over the longest row's action count, each iteration O(B).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got {tuple(rewards.shape)}")
    shape = rewards.shape
    _check_2d("values", values, shape)
    _check_2d("action_mask", action_mask, shape)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    batch, _ = shape
    device = rewards.device
    mask = action_mask.bool()
    if bool(((rewards != 0) & ~mask).any()):
        raise ValueError("nonzero reward on a non-action position")
    lam_t = _lambda_per_row(lam, batch, device)

    # Gather each row's action positions, in order, to the front: a stable sort of "not action"
    # keeps the action tokens' order, so the recurrence below never sees an observation token.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    lengths = mask.sum(dim=1)
    n_max = int(lengths.max().item()) if batch else 0
    advantages = torch.zeros(shape, dtype=torch.float32, device=device)
    returns = torch.zeros(shape, dtype=torch.float32, device=device)
    if n_max == 0:
        return advantages, returns
    order = order[:, :n_max]
    valid = torch.arange(n_max, device=device)[None, :] < lengths[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=device)
    # Values at padding slots are replaced by 0 so they act as the terminal V = 0 and a huge or
    # non-finite value at an observation/padding position cannot reach the arithmetic.
    v = torch.where(valid, values.float().gather(1, order), zero)
    r = torch.where(valid, rewards.float().gather(1, order), zero)
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = r + gamma * next_v - v
    decay = gamma * lam_t
    adv = torch.empty_like(delta)
    running = torch.zeros(batch, dtype=torch.float32, device=device)
    for j in range(n_max - 1, -1, -1):
        running = delta[:, j] + decay * running
        adv[:, j] = running
    # Slots past a row's length have δ = 0 and zero successors, so their advantage is already 0.
    advantages.scatter_(1, order, torch.where(valid, adv, zero))
    returns.scatter_(1, order, torch.where(valid, adv + v, zero))
    return advantages, returns


def length_adaptive_lambda(action_lengths: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """Length-adaptive GAE λ for the policy: ``λ = 1 − 1/(α·l)`` per row, clamped to [0, 1].

    Source: SAO §3 experimental setup (papers/003 §三(一)), α = 1.5, l = number of action tokens of
    the trajectory (docs/design.md §5.3). For ``α·l < 1`` (e.g. l = 0) the formula goes negative or
    infinite; it is clamped at 0 (one-step TD advantage), which only affects degenerate rows.

    Args:
        action_lengths: [B] integer or float tensor, action tokens per row.
        alpha: α > 0.

    Returns:
        [B] float32 tensor of λ values in [0, 1].

    Raises:
        ValueError: alpha <= 0 or action_lengths not 1-D.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if action_lengths.dim() != 1:
        raise ValueError(f"action_lengths must be [B], got {tuple(action_lengths.shape)}")
    lengths = action_lengths.to(torch.float32)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(min=0.0, max=1.0)


def _segments(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Segment index per position: 1..S for the contiguous action runs of a row, 0 elsewhere."""
    prev = torch.zeros_like(mask)
    prev[:, 1:] = mask[:, :-1]
    starts = mask & ~prev
    seg = torch.cumsum(starts.to(torch.long), dim=1) * mask.to(torch.long)
    n_seg = int(seg.max().item()) if seg.numel() else 0
    return seg, n_seg


def _segment_table(values: torch.Tensor, mask: torch.Tensor, mode: StepMode) -> tuple[torch.Tensor, ...]:
    """Per-segment step value and helpers: (table [B, S+1], seg [B, T], ends [B, T] bool)."""
    if mode not in ("mean", "last"):
        raise ValueError(f"mode must be 'mean' or 'last', got {mode!r}")
    batch, _ = mask.shape
    seg, n_seg = _segments(mask)
    vals = torch.where(mask, values.float(), torch.zeros((), device=values.device))
    nxt = torch.zeros_like(mask)
    nxt[:, :-1] = mask[:, 1:]
    ends = mask & ~nxt
    table = torch.zeros(batch, n_seg + 1, dtype=torch.float32, device=values.device)
    if mode == "mean":
        counts = torch.zeros_like(table).scatter_add_(1, seg, mask.float())
        table.scatter_add_(1, seg, vals)
        table = table / counts.clamp(min=1)
    else:
        # Only segment ends write; other positions write into slot 0 (non-action), then reset it.
        table.scatter_(1, torch.where(ends, seg, torch.zeros_like(seg)), vals * ends)
    table[:, 0] = 0.0
    return table, seg, ends


def step_values(values: torch.Tensor, action_mask: torch.Tensor, mode: StepMode = "mean") -> torch.Tensor:
    """Replace each contiguous action segment's token values by one step value.

    Ablation of SAO appendix A.1 (papers/001 §3.5): a step (one model turn) takes the mean of its
    tokens' values (``mode="mean"``) or its last token's value (``mode="last"``). Non-action
    positions keep their input values.

    Note: ``token_gae`` on these values equals step-level GAE only when ``γ·λ = 1`` (inside a step,
    token GAE still decays by γλ per token). ``step_gae`` computes the exact step-level variant.

    Args:
        values: [B, T] float, ``values[:, t] = V(s_t)``.
        action_mask: [B, T] 0/1 float or bool.
        mode: ``"mean"`` or ``"last"``.

    Returns:
        [B, T] float32.

    Raises:
        ValueError: shapes differ or unknown mode.
    """
    _check_2d("action_mask", action_mask, values.shape)
    mask = action_mask.bool()
    table, seg, _ = _segment_table(values, mask, mode)
    return torch.where(mask, table.gather(1, seg), values.float())


def step_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
    mode: StepMode = "mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-level GAE (SAO appendix A.1 ablation): one advantage per contiguous action segment.

    Each segment i is one step with value ``V_i`` (mean or last of its token values, see
    ``step_values``) and reward ``R_i`` (sum of its token rewards). ``δ_i = R_i + γ V_{i+1} − V_i``,
    ``Â_i = δ_i + γλ Â_{i+1}``, ``V`` after the last step = 0; every token of step i gets ``Â_i``
    and return ``Â_i + V_i``. Observation and padding positions get 0. γ and λ act per step here.

    Args:
        rewards: [B, T] float, rewards on action tokens only.
        values: [B, T] float.
        action_mask: [B, T] 0/1 float or bool.
        gamma: discount per step, in [0, 1].
        lam: float or [B] tensor in [0, 1].
        mode: ``"mean"`` or ``"last"``.

    Returns:
        ``(advantages, returns)``, both [B, T] float32.

    Raises:
        ValueError: as ``token_gae``, or unknown mode.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got {tuple(rewards.shape)}")
    _check_2d("values", values, rewards.shape)
    _check_2d("action_mask", action_mask, rewards.shape)
    mask = action_mask.bool()
    if bool(((rewards != 0) & ~mask).any()):
        raise ValueError("nonzero reward on a non-action position")
    table, seg, ends = _segment_table(values, mask, mode)
    step_reward = torch.zeros_like(table).scatter_add_(1, seg, torch.where(mask, rewards.float(), 0.0))
    step_reward[:, 0] = 0.0
    # One representative token per step (its last token) carries the step's value and reward, so
    # token_gae over those tokens alone is exactly GAE over steps.
    rep_rewards = torch.where(ends, step_reward.gather(1, seg), 0.0)
    rep_values = torch.where(ends, table.gather(1, seg), 0.0)
    rep_adv, _ = token_gae(rep_rewards, rep_values, ends, gamma, lam)
    step_adv = torch.zeros_like(table).scatter_add_(1, seg, rep_adv)
    step_adv[:, 0] = 0.0
    advantages = torch.where(mask, step_adv.gather(1, seg), 0.0)
    returns = torch.where(mask, advantages + table.gather(1, seg), 0.0)
    return advantages, returns
