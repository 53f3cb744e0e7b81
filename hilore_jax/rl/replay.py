"""Rollout-level replay for GRPO: fresh-anchored update batches, age-bounded and |A|^alpha-prioritised.

Order of operations in training step t (the trainer's contract):
  1. sample this step's fresh rollouts with the current policy and score them (advantages A, per row);
  2. `batch, replayed, stats = buf.compose(fresh, t, rng)`: evicts rows older than tau_max, then appends replayed
     rows drawn from rows stored at steps < t, so a batch never replays its own fresh rows;
  3. `buf.add(rollout, adv, t)`: stores this step's rollouts with birth step t.
Age = step - birth: a rollout born at step s is replayable at steps s+1 .. s+tau_max and gone at s+tau_max+1.
Replay is not consumptive: a stored row may be drawn again at later steps until it ages out or is displaced.
Sampling reads only `rng`: pass one derived from the step (`np.random.default_rng([seed, t, 1])`), and a buffer
restored with `from_state` replays exactly what the uninterrupted run did.

Capacity: when stored + incoming rows exceed `capacity`, rows leave in the order (oldest birth, then smallest |A|,
then earliest inserted); incoming rows are the youngest, so they are dropped only when the buffer holds nothing older.

`naive` mode, the ablation baseline, differs only where named: no age bound, uniform sampling, and whole groups of G
rows stored, evicted and replayed together. A group is stored when any of its rows has A != 0 (a group of all-zero
advantages carries no gradient in either mode); its zero-advantage rows are then kept with it.
"""

from __future__ import annotations

import numpy as np

from hilore_jax.rl.config import ReplayConfig

BATCH_KEYS = ("prompt_ids", "prompt_mask", "tokens", "mask", "adv", "old_logp")
# stored field -> (trailing width, dtype): the one table the storage, state() and from_state() derive from.
# old_logp holds the behaviour (sampling) log-probs, which are the importance ratio's denominator when replayed.
FIELDS = {"prompt_ids": ("P", np.int32), "prompt_mask": ("P", np.int32), "tokens": ("N", np.int32),
          "mask": ("N", np.int32), "old_logp": ("N", np.float32), "reward": (None, np.float32),
          "adv": (None, np.float32), "birth": (None, np.int32), "seq": (None, np.int32), "valid": (None, np.bool_)}
COUNTERS = ("next_seq", "evicted")
STAT_KEYS = ("replay/size", "replay/frac", "replay/age_mean", "replay/age_max", "replay/evicted",
             "replay/adv_abs_mean_fresh", "replay/adv_abs_mean_replayed")


def round_half_up(x: float) -> int:
  # Python's round() goes to even (round(2.5) == 2); a share should not flip with the parity of the fresh count
  return int(np.floor(x + 0.5))


def max_replay_rows(cfg: ReplayConfig, n_fresh: int) -> int:
  """The most rows compose() appends to n_fresh fresh rows (fewer while the buffer holds fewer replayable)."""
  if not cfg.enabled:
    return 0
  if cfg.mode == "naive":
    return cfg.group_size * round_half_up(cfg.share * n_fresh / cfg.group_size)
  return round_half_up(cfg.share * n_fresh)


class ReplayBuffer:
  """Fixed-capacity structure-of-arrays store of rollouts; state() is a fixed-shape tree of arrays orbax can save."""

  def __init__(self, cfg: ReplayConfig, prompt_len: int, completion_len: int):
    if cfg.group_size < 2:
      raise ValueError(f"replay.group_size must be set to rollout.num_generations, got {cfg.group_size}")
    self.cfg = cfg
    widths = {"P": (prompt_len,), "N": (completion_len,), None: ()}
    self._a = {k: np.zeros((cfg.capacity, *widths[w]), dt) for k, (w, dt) in FIELDS.items()}
    self._next_seq = 0  # rows seen so far (stored or not): a row's seq // G is its global group id
    self._evicted = 0  # rows evicted since the last compose, reported there

  @property
  def size(self) -> int:
    return int(self._a["valid"].sum())

  def state(self) -> dict:
    """Copies of every stored array plus the counters as 0-d int32 arrays: all of it, for an exact resume."""
    return {**{k: v.copy() for k, v in self._a.items()},
            "next_seq": np.asarray(self._next_seq, np.int32), "evicted": np.asarray(self._evicted, np.int32)}

  @classmethod
  def from_state(cls, cfg: ReplayConfig, state: dict) -> ReplayBuffer:
    """The buffer that produced `state` (numpy, jax or orbax-restored arrays)."""
    buf = cls(cfg, np.shape(state["prompt_ids"])[1], np.shape(state["tokens"])[1])
    buf.load_state(state)
    return buf

  def load_state(self, state: dict):
    """Replaces what the buffer holds with `state` (from state(); its widths and capacity must be this buffer's)."""
    arrays = {}
    for k, (_, dt) in FIELDS.items():
      v = np.asarray(state[k]).astype(dt)
      if v.shape != self._a[k].shape:
        raise ValueError(f"replay state {k!r} has shape {v.shape}, expected {self._a[k].shape} "
                         f"(replay.capacity={self.cfg.capacity})")
      arrays[k] = v
    self._a = arrays
    self._next_seq, self._evicted = int(state["next_seq"]), int(state["evicted"])

  def _check_widths(self, prompt_ids, tokens):
    P, N = self._a["prompt_ids"].shape[1], self._a["tokens"].shape[1]
    if np.shape(prompt_ids)[1:] != (P,) or np.shape(tokens)[1:] != (N,):
      raise ValueError(f"replay: rows of shape prompt {np.shape(prompt_ids)}, completion {np.shape(tokens)} do not "
                       f"match the buffer's widths P={P}, N={N}; every row of a run must be padded to "
                       f"rollout.max_prompt_len and rollout.max_new_tokens")

  def eligible(self, step: int) -> np.ndarray:
    """[C] rows replayable at `step`: stored at an earlier step and (fresh_anchored) at most tau_max steps old."""
    birth = self._a["birth"]
    ok = self._a["valid"] & (birth < step)
    if self.cfg.mode == "fresh_anchored":
      ok &= step - birth <= self.cfg.tau_max
    return ok

  def evict(self, step: int) -> int:
    """Removes rows with step - birth > tau_max (none in naive mode); returns how many."""
    if self.cfg.mode == "naive":
      return 0
    stale = self._a["valid"] & (step - self._a["birth"] > self.cfg.tau_max)
    self._a["valid"] &= ~stale
    self._evicted += int(stale.sum())
    return int(stale.sum())

  def add(self, roll, adv_B: np.ndarray, step: int) -> int:
    """Stores the rollouts sampled at `step` (a `Rollout`: G consecutive rows per prompt); returns rows stored."""
    cfg, G, a = self.cfg, self.cfg.group_size, self._a
    if not cfg.enabled:
      return 0
    adv_B = np.asarray(adv_B, np.float32).reshape(-1)
    B = len(adv_B)
    if B % G or len(roll.tokens) != B:
      raise ValueError(f"replay.add: {len(roll.tokens)} rows and {B} advantages; both must be one multiple of "
                       f"replay.group_size={G}")
    self._check_widths(roll.prompt_ids, roll.tokens)
    self.evict(step)
    seq_B = self._next_seq + np.arange(B)
    self._next_seq += B
    naive = cfg.mode == "naive"
    keep_B = np.repeat((adv_B.reshape(-1, G) != 0).any(1), G) if naive else adv_B != 0
    new = np.flatnonzero(keep_B)
    # capacity: rank stored and incoming rows together in eviction order and drop the overflow from the front
    old = np.flatnonzero(a["valid"])
    birth = np.concatenate([a["birth"][old], np.full(len(new), step)])
    seq = np.concatenate([a["seq"][old], seq_B[new]])
    prio = np.concatenate([np.abs(a["adv"][old]), np.abs(adv_B[new])])
    # naive: seq order keeps each group's rows contiguous, and every count is a multiple of G, so groups go whole
    order = np.lexsort((seq, birth) if naive else (seq, prio, birth))
    drop = order[:max(len(old) + len(new) - cfg.capacity, 0)]
    a["valid"][old[drop[drop < len(old)]]] = False
    new = np.delete(new, drop[drop >= len(old)] - len(old))
    self._evicted += len(drop)
    slots = np.flatnonzero(~a["valid"])[:len(new)]
    src = {"prompt_ids": roll.prompt_ids, "prompt_mask": roll.prompt_mask, "tokens": roll.tokens, "mask": roll.mask,
           "old_logp": roll.sample_logprobs, "reward": roll.rewards, "adv": adv_B, "birth": np.full(B, step),
           "seq": seq_B}
    for k, v in src.items():
      a[k][slots] = np.asarray(v)[new]
    a["valid"][slots] = True
    return len(new)

  def replay_count(self, n_fresh: int, step: int) -> int:
    """Rows compose() replays next to n_fresh fresh rows: round(share * n_fresh), whole groups in naive mode."""
    ok = self.eligible(step)
    if self.cfg.mode == "naive":
      G = self.cfg.group_size
      return min(max_replay_rows(self.cfg, n_fresh), G * len(np.unique(self._a["seq"][ok] // G)))
    return min(max_replay_rows(self.cfg, n_fresh), int(ok.sum()))

  def sample(self, n: int, step: int, rng: np.random.Generator) -> np.ndarray:
    """Slots of n distinct replayable rows: each draw P(row) ~ |A|^alpha (fresh_anchored), uniform groups (naive)."""
    ok = np.flatnonzero(self.eligible(step))
    if n == 0:
      return np.zeros(0, np.int64)
    if n > len(ok):
      raise ValueError(f"replay.sample: {n} rows asked, {len(ok)} replayable at step {step}")
    if self.cfg.mode == "naive":
      G = self.cfg.group_size
      if n % G:
        raise ValueError(f"replay.sample: naive mode replays whole groups, {n} is not a multiple of {G}")
      gid = self._a["seq"][ok] // G
      pick = rng.choice(np.unique(gid), size=n // G, replace=False)
      rows = ok[np.isin(gid, pick)]
      return rows[np.argsort(self._a["seq"][rows])]
    # without replacement numpy draws successively from the remaining rows, so the first draw is exactly |A|^alpha
    w = np.abs(self._a["adv"][ok]).astype(np.float64) ** self.cfg.priority_exponent
    return rng.choice(ok, size=n, replace=False, p=w / w.sum())

  def rows(self, slots: np.ndarray) -> dict:
    """The train-step keys of stored rows, with old_logp = their behaviour log-probs, plus their birth steps."""
    return {k: self._a[k][slots] for k in (*BATCH_KEYS, "birth")}

  def compose(self, fresh: dict, step: int, rng: np.random.Generator) -> tuple[dict, np.ndarray, dict]:
    """Update batch = every fresh row, then replayed rows; also the [R] `replayed` flag and the replay/* stats.

    fresh holds prompt_ids, prompt_mask, tokens, mask, adv and optionally old_logp (e.g. the sampling log-probs).
    Without it the fresh rows' old_logp is NaN, for the caller to overwrite with recomputed values where
    `~replayed`: NaN, so that forgetting it surfaces as a non-finite loss instead of a silently wrong ratio.
    Call before add(step); replay/size counts the rows stored before this step's add.
    """
    unknown = set(fresh) - set(BATCH_KEYS)
    if unknown:
      raise ValueError(f"replay.compose: unexpected fresh keys {sorted(unknown)} (add ref_logp after compose)")
    self._check_widths(fresh["prompt_ids"], fresh["tokens"])
    n_fresh = len(fresh["adv"])
    self.evict(step)
    slots = self.sample(self.replay_count(n_fresh, step) if self.cfg.enabled else 0, step, rng)
    rep = self.rows(slots)
    fresh = {"old_logp": np.full(np.shape(fresh["tokens"]), np.nan, np.float32), **fresh}
    batch = {k: np.concatenate([np.asarray(fresh[k], FIELDS[k][1]), rep[k]]) for k in BATCH_KEYS}
    replayed_R = np.concatenate([np.zeros(n_fresh, bool), np.ones(len(slots), bool)])
    age = step - rep["birth"]
    n_rep = len(slots)
    stats = {"replay/size": self.size, "replay/frac": n_rep / max(n_fresh + n_rep, 1),
             "replay/age_mean": float(age.mean()) if n_rep else 0.0, "replay/age_max": int(age.max()) if n_rep else 0,
             "replay/evicted": self._evicted,
             "replay/adv_abs_mean_fresh": float(np.abs(batch["adv"][:n_fresh]).mean()) if n_fresh else 0.0,
             "replay/adv_abs_mean_replayed": float(np.abs(rep["adv"]).mean()) if n_rep else 0.0}
    self._evicted = 0
    return batch, replayed_R, stats
