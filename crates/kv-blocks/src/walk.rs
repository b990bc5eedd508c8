//! Finding the reusable prefix of a prompt: a walk down the tree that sees lazy runs as the
//! chains of nodes they stand for, so that queries need not materialize them.

use crate::Tier;
use crate::group::{Group, Opts, SeqInfo};
use crate::lazy::{Owners, RunState};
use crate::tree::{NO_RUN, Parent};

/// A position met while walking a prompt down the tree: a root, a node, or block `i` of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum At {
    Root(u32),
    Node(u32),
    Lazy(u32, u32),
}

impl At {
    /// The tree parent this position stands for; `None` inside a run.
    pub(crate) fn parent(self) -> Option<Parent> {
        match self {
            At::Root(r) => Some(Parent::Root(r)),
            At::Node(n) => Some(Parent::Node(n)),
            At::Lazy(..) => None,
        }
    }

    /// The node this position is; `None` for a root or inside a run.
    pub(crate) fn node(self) -> Option<u32> {
        match self {
            At::Node(n) => Some(n),
            _ => None,
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> u32 {
    a.iter().zip(b).take_while(|(x, y)| x == y).count() as u32
}

impl Group {
    /// The run under node `n`, if any.
    fn tail_of(&self, at: At) -> Option<u32> {
        let n = at.node()?;
        let r = self.tree.node(n).tail;
        (r != NO_RUN).then_some(r)
    }

    /// The children of a position: the nodes under a root or node, the first block of the run
    /// under a head, the next block inside a run.
    pub(crate) fn kids(&self, at: At) -> impl Iterator<Item = At> + '_ {
        let (nodes, lazy): (&[u32], Option<At>) = match (at, self.tail_of(at)) {
            (_, Some(r)) => (&[], Some(At::Lazy(r, 0))),
            (At::Lazy(r, i), _) => (&[], (i + 1 < self.run(r).len).then_some(At::Lazy(r, i + 1))),
            (at, None) => (at.parent().map_or(&[][..], |p| self.tree.children(p)), None),
        };
        nodes.iter().map(|&c| At::Node(c)).chain(lazy)
    }

    /// The tokens of the block at a node or run position.
    fn tokens_at<'a>(&'a self, at: At, owners: &'a dyn Owners) -> &'a [u32] {
        match at {
            At::Node(n) => self.tree.tokens(n),
            At::Lazy(r, i) => self.run_tokens(r, i, owners),
            At::Root(_) => &[],
        }
    }

    /// Whether a request in `tier` can share the block at `at` as is (same tier), or after
    /// onboarding it (a primary request and an unreferenced secondary block).
    fn can_share(&self, at: At, tier: Tier) -> bool {
        match at {
            At::Node(n) => {
                let loc = self.tree.node(n).loc;
                loc.tier == tier
                    || (tier == Tier::Primary && self.pools[1].refcount[loc.block.index()] == 0)
            }
            At::Lazy(r, _) => {
                let run = self.run(r);
                run.tier == tier
                    || (tier == Tier::Primary && matches!(run.state, RunState::Released { .. }))
            }
            At::Root(_) => false,
        }
    }

    /// Whether a request in `tier` may take the block at `at` over for a partial reuse without
    /// copying: same tier, nothing under it, unreferenced.
    pub(crate) fn can_take(&self, at: At, tier: Tier) -> bool {
        match at {
            At::Node(n) => {
                let node = self.tree.node(n);
                node.loc.tier == tier
                    && self.tree.childless(n)
                    && self.pools[tier.index()].refcount[node.loc.block.index()] == 0
            }
            At::Lazy(r, i) => {
                let run = self.run(r);
                run.tier == tier
                    && i + 1 == run.len
                    && matches!(run.state, RunState::Released { .. })
            }
            At::Root(_) => false,
        }
    }

    /// The child of `at` sharing the longest prefix with `want` that this request can use.
    pub(crate) fn best_partial(
        &self,
        at: At,
        want: &[u32],
        tier: Tier,
        opts: &Opts,
        owners: &dyn Owners,
    ) -> Option<(At, u32)> {
        self.kids(at)
            .filter(|&c| opts.copy_on_partial_reuse || self.can_take(c, tier))
            .map(|c| (c, common_prefix(self.tokens_at(c, owners), want)))
            .filter(|&(_, k)| k > 0)
            .max_by_key(|&(_, k)| k)
    }

    /// Walks the full blocks of the request that are cached and shareable, up to `limit` tokens:
    /// the last position reached and the positions on the way.
    pub(crate) fn walk(
        &self,
        info: &SeqInfo<'_>,
        limit: u32,
        owners: &dyn Owners,
    ) -> Option<(At, Vec<At>)> {
        let bs = self.bs;
        let mut at = At::Root(self.tree.find_root(info.root_key)?);
        let mut path = Vec::new();
        let mut m = 0u32;
        let fits = |m: u32| u64::from(m + 1) * u64::from(bs) <= u64::from(limit);
        let block = |m: u32| &info.tokens[(m * bs) as usize..((m + 1) * bs) as usize];
        while fits(m) {
            let run_next = match (at, self.tail_of(at)) {
                (_, Some(r)) => Some((r, 0)),
                (At::Lazy(r, i), _) => Some((r, i + 1)),
                _ => None,
            };
            if let Some((r, mut j)) = run_next {
                // A run's blocks are one chain in one tier: compare them in place until the
                // prompt and the run part, and stop there (nothing else hangs inside a run).
                if !self.can_share(At::Lazy(r, j), info.tier) {
                    break;
                }
                let (run, (tokens, _)) = (self.run(r), self.run_data(r, owners));
                let at_block = |j: u32| {
                    let start = ((run.first + j) * bs) as usize;
                    &tokens[start..start + bs as usize]
                };
                while j < run.len && fits(m) && at_block(j) == block(m) {
                    at = At::Lazy(r, j);
                    path.push(at);
                    m += 1;
                    j += 1;
                }
                break;
            }
            let next = at
                .parent()
                .and_then(|p| self.tree.lookup(p, block(m)))
                .map(At::Node);
            match next {
                Some(c) if self.can_share(c, info.tier) => {
                    at = c;
                    path.push(c);
                    m += 1;
                }
                _ => break,
            }
        }
        Some((at, path))
    }

    /// Tokens of the request's first `limit` tokens this group could reuse: shareable full
    /// blocks, then up to one block's worth of tokens copied (or taken over) from the child that
    /// matches best.
    pub(crate) fn match_len(
        &self,
        info: &SeqInfo<'_>,
        limit: u32,
        opts: &Opts,
        owners: &dyn Owners,
    ) -> u32 {
        let Some((at, path)) = self.walk(info, limit, owners) else {
            return 0;
        };
        let full = path.len() as u32 * self.bs;
        if !opts.enable_partial_reuse || full >= limit {
            return full;
        }
        let end = limit.min(full + self.bs) as usize;
        let want = &info.tokens[full as usize..end];
        full + self
            .best_partial(at, want, info.tier, opts, owners)
            .map_or(0, |(_, k)| k)
    }

    /// Whether exactly `len` tokens can be reused: the shareable full blocks, plus a source for
    /// the rest (at most one block's worth).
    pub(crate) fn can_reuse_exactly(
        &self,
        info: &SeqInfo<'_>,
        len: u32,
        opts: &Opts,
        owners: &dyn Owners,
    ) -> bool {
        let Some((at, path)) = self.walk(info, len, owners) else {
            return len == 0;
        };
        let full = path.len() as u32 * self.bs;
        let rest = len - full;
        rest == 0
            || (opts.enable_partial_reuse
                && rest <= self.bs
                && self
                    .best_partial(
                        at,
                        &info.tokens[full as usize..len as usize],
                        info.tier,
                        opts,
                        owners,
                    )
                    .is_some_and(|(_, got)| got >= rest))
    }
}
