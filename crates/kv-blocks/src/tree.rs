//! The radix tree of reusable full blocks, one node per block under its parent. Tokens live in one
//! arena (`tokens_per_block` slots per node), so storing a block is a copy into place.
//!
//! A node's children are found through a hash index keyed by (parent, tokens), except where a
//! node has exactly one child that was never indexed: a chain. Storing a request's prompt makes
//! a chain, and a chain costs no hashing: the next block is found by comparing tokens with the
//! only child. The index takes a child when its parent gains a second one, and every child of
//! a root. Chained content hashes (for events and [`crate::CachedBlock`]) are kept on the nodes
//! when the manager reports events, and computed on demand otherwise.

use std::hash::{Hash, Hasher};

use rustc_hash::{FxHashMap, FxHasher};

use crate::{BlockLoc, Priority};

/// What roots a prefix: the cache salt and the request-wide extra ids. Requests with different
/// root keys never share a block, because their chains start at different roots.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RootKey {
    pub(crate) salt: Option<String>,
    pub(crate) extra: Vec<u64>,
}

/// The parent of a node: a root or another node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parent {
    Root(u32),
    Node(u32),
}

impl Parent {
    fn code(self) -> u64 {
        match self {
            Parent::Root(r) => (1 << 32) | u64::from(r),
            Parent::Node(n) => u64::from(n),
        }
    }
}

/// A node's or a root's children: none and one are kept inline, so a chain allocates nothing.
#[derive(Debug, Default)]
pub(crate) enum Kids {
    #[default]
    None,
    One(u32),
    Many(Vec<u32>),
}

impl Kids {
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            Kids::None => &[],
            Kids::One(c) => std::slice::from_ref(c),
            Kids::Many(v) => v,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    fn push(&mut self, c: u32) {
        *self = match std::mem::take(self) {
            Kids::None => Kids::One(c),
            Kids::One(a) => Kids::Many(vec![a, c]),
            Kids::Many(mut v) => {
                v.push(c);
                Kids::Many(v)
            }
        };
    }

    fn remove(&mut self, c: u32) {
        match self {
            Kids::One(a) if *a == c => *self = Kids::None,
            Kids::Many(v) => v.retain(|&x| x != c),
            _ => {}
        }
    }
}

#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) parent: Parent,
    pub(crate) loc: BlockLoc,
    /// The chained content hash when the tree keeps them (events on), else 0.
    hash: u64,
    /// The hash of the node's tokens, valid when `indexed`.
    token_hash: u64,
    /// Whether the node is in the hash index (else it is its parent's only child).
    indexed: bool,
    pub(crate) children: Kids,
    /// Children resident in each tier.
    pub(crate) children_in: [u32; 2],
    pub(crate) priority: Priority,
    /// Bumped whenever the priority is set, so stale expiry entries can be recognised.
    pub(crate) prio_gen: u32,
    pub(crate) last_used: u64,
    /// Bumped when the node is removed, so stale references can be recognised.
    pub(crate) generation: u32,
    pub(crate) alive: bool,
    depth: u32,
    /// The lazy run hanging under this node ([`NO_RUN`] for none); a node with a run has no
    /// children of its own.
    pub(crate) tail: u32,
}

/// Marks a node without a lazy run under it.
pub(crate) const NO_RUN: u32 = u32::MAX;

struct Root {
    key: RootKey,
    hash: u64,
    children: Kids,
}

/// The outcome of [`Tree::insert`].
pub(crate) enum Insert {
    /// A new node.
    New(u32),
    /// A node with the same tokens exists under the parent.
    Existing(u32),
    /// Another node's tokens hash the same; nothing was stored.
    Collision,
}

pub(crate) struct Tree {
    bs: usize,
    /// Whether every node keeps its chained hash (`Node::hash`).
    eager_hashes: bool,
    pub(crate) nodes: Vec<Node>,
    tokens: Vec<u32>,
    free_nodes: Vec<u32>,
    index: FxHashMap<(u64, u64), u32>,
    roots: Vec<Option<Root>>,
    root_index: FxHashMap<RootKey, u32>,
    free_roots: Vec<u32>,
}

fn hash_tokens(tokens: &[u32]) -> u64 {
    let mut h = FxHasher::default();
    tokens.hash(&mut h);
    h.finish()
}

fn chain(parent: u64, token_hash: u64) -> u64 {
    let mut h = FxHasher::default();
    h.write_u64(parent);
    h.write_u64(token_hash);
    // One extra mixing round: Fx alone spreads high bits poorly.
    let x = h.finish();
    (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

impl Tree {
    /// A tree of blocks of `tokens_per_block` tokens; `eager_hashes` keeps every node's chained
    /// hash up to date as it is stored (for events) instead of computing it when asked.
    pub(crate) fn new(tokens_per_block: u32, eager_hashes: bool) -> Self {
        Tree {
            bs: tokens_per_block as usize,
            eager_hashes,
            nodes: Vec::new(),
            tokens: Vec::new(),
            free_nodes: Vec::new(),
            index: FxHashMap::default(),
            roots: Vec::new(),
            root_index: FxHashMap::default(),
            free_roots: Vec::new(),
        }
    }

    pub(crate) fn find_root(&self, key: &RootKey) -> Option<u32> {
        self.root_index.get(key).copied()
    }

    pub(crate) fn get_or_create_root(&mut self, key: &RootKey) -> u32 {
        if let Some(r) = self.find_root(key) {
            return r;
        }
        let mut h = FxHasher::default();
        key.hash(&mut h);
        let root = Root {
            key: key.clone(),
            hash: h.finish(),
            children: Kids::None,
        };
        let r = match self.free_roots.pop() {
            Some(r) => {
                self.roots[r as usize] = Some(root);
                r
            }
            None => {
                self.roots.push(Some(root));
                (self.roots.len() - 1) as u32
            }
        };
        self.root_index.insert(key.clone(), r);
        r
    }

    pub(crate) fn node(&self, n: u32) -> &Node {
        &self.nodes[n as usize]
    }

    pub(crate) fn node_mut(&mut self, n: u32) -> &mut Node {
        &mut self.nodes[n as usize]
    }

    /// Whether node `n` has neither children nor a lazy run under it.
    pub(crate) fn childless(&self, n: u32) -> bool {
        let node = self.node(n);
        node.children.is_empty() && node.tail == NO_RUN
    }

    /// The chained hash of a block holding `tokens` under a parent whose chained hash is
    /// `parent`.
    pub(crate) fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
        chain(parent, hash_tokens(tokens))
    }

    pub(crate) fn tokens(&self, n: u32) -> &[u32] {
        let start = n as usize * self.bs;
        &self.tokens[start..start + self.bs]
    }

    /// The key of the root a node descends from, and the node's depth (0 for a first block).
    pub(crate) fn root_key_of(&self, n: u32) -> (&RootKey, u32) {
        let r = self.root_of(n);
        let root = self.roots[r as usize]
            .as_ref()
            .expect("invariant: a live node's root is live");
        (&root.key, self.node(n).depth)
    }

    /// Node `n`, its parent, and so on up to a first block.
    fn up(&self, n: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(n), |&m| match self.node(m).parent {
            Parent::Node(p) => Some(p),
            Parent::Root(_) => None,
        })
    }

    /// The root of the first block `top`, the last node of [`up`](Self::up).
    fn root_above(&self, top: u32) -> u32 {
        match self.node(top).parent {
            Parent::Root(r) => r,
            Parent::Node(_) => unreachable!("invariant: `up` ends at a first block"),
        }
    }

    fn root_of(&self, n: u32) -> u32 {
        self.root_above(self.up(n).last().expect("invariant: `up` yields n first"))
    }

    fn root_hash(&self, r: u32) -> u64 {
        self.roots[r as usize].as_ref().map_or(0, |root| root.hash)
    }

    /// The chained content hash of node `n`: the root's hash, then each block's tokens from the
    /// first block down to `n`.
    pub(crate) fn hash(&self, n: u32) -> u64 {
        if self.eager_hashes {
            return self.node(n).hash;
        }
        let path: Vec<u32> = self.up(n).collect();
        let top = *path.last().expect("invariant: `up` yields n first");
        path.iter()
            .rev()
            .fold(self.root_hash(self.root_above(top)), |h, &m| {
                chain(h, hash_tokens(self.tokens(m)))
            })
    }

    /// The chained hash of a parent: `None` for a root.
    pub(crate) fn parent_hash(&self, parent: Parent) -> Option<u64> {
        match parent {
            Parent::Node(n) => Some(self.hash(n)),
            Parent::Root(_) => None,
        }
    }

    pub(crate) fn children(&self, parent: Parent) -> &[u32] {
        match parent {
            Parent::Node(n) => self.node(n).children.as_slice(),
            Parent::Root(r) => self.roots[r as usize]
                .as_ref()
                .map_or(&[], |root| root.children.as_slice()),
        }
    }

    /// The parent's only child, when it was never indexed (a chain link).
    fn chain_child(&self, parent: Parent) -> Option<u32> {
        match self.children(parent) {
            &[c] if !self.node(c).indexed => Some(c),
            _ => None,
        }
    }

    /// The child of `parent` holding exactly `tokens` (a full block).
    pub(crate) fn lookup(&self, parent: Parent, tokens: &[u32]) -> Option<u32> {
        if let Some(c) = self.chain_child(parent) {
            return (self.tokens(c) == tokens).then_some(c);
        }
        let n = *self.index.get(&(parent.code(), hash_tokens(tokens)))?;
        (self.tokens(n) == tokens).then_some(n)
    }

    /// Puts node `n` into the hash index; false if another node holds its key.
    fn index_node(&mut self, n: u32) -> bool {
        let key = (self.node(n).parent.code(), hash_tokens(self.tokens(n)));
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key, n);
        let node = self.node_mut(n);
        node.token_hash = key.1;
        node.indexed = true;
        true
    }

    /// Stores a full block under `parent`.
    pub(crate) fn insert(
        &mut self,
        parent: Parent,
        tokens: &[u32],
        loc: BlockLoc,
        priority: Priority,
        last_used: u64,
    ) -> Insert {
        debug_assert_eq!(tokens.len(), self.bs);
        debug_assert!(
            !matches!(parent, Parent::Node(p) if self.node(p).tail != NO_RUN),
            "a node with a lazy run gains a child only once the run is nodes"
        );
        // A first child of a node starts a chain and is not indexed. Any other child is, and an
        // unindexed only child is indexed as its parent gains a second one.
        let first_of_node = matches!(parent, Parent::Node(_)) && self.children(parent).is_empty();
        let mut token_hash = 0;
        if !first_of_node {
            if let Some(c) = self.chain_child(parent) {
                if self.tokens(c) == tokens {
                    return Insert::Existing(c);
                }
                let indexed = self.index_node(c);
                debug_assert!(indexed, "an unindexed child's key is free in the index");
            }
            token_hash = hash_tokens(tokens);
            if let Some(&n) = self.index.get(&(parent.code(), token_hash)) {
                return if self.tokens(n) == tokens {
                    Insert::Existing(n)
                } else {
                    Insert::Collision
                };
            }
        }
        let (parent_hash, depth) = match parent {
            Parent::Node(p) => (self.node(p).hash, self.node(p).depth + 1),
            Parent::Root(r) => (self.root_hash(r), 0),
        };
        let hash = if self.eager_hashes {
            let th = if first_of_node {
                hash_tokens(tokens)
            } else {
                token_hash
            };
            chain(parent_hash, th)
        } else {
            0
        };
        let node = Node {
            parent,
            loc,
            hash,
            token_hash,
            indexed: !first_of_node,
            children: Kids::None,
            children_in: [0, 0],
            priority,
            prio_gen: 0,
            last_used,
            generation: 0,
            alive: true,
            depth,
            tail: NO_RUN,
        };
        let n = match self.free_nodes.pop() {
            Some(n) => {
                let generation = self.nodes[n as usize].generation;
                self.nodes[n as usize] = Node { generation, ..node };
                let start = n as usize * self.bs;
                self.tokens[start..start + self.bs].copy_from_slice(tokens);
                n
            }
            None => {
                self.nodes.push(node);
                self.tokens.extend_from_slice(tokens);
                (self.nodes.len() - 1) as u32
            }
        };
        if !first_of_node {
            self.index.insert((parent.code(), token_hash), n);
        }
        match parent {
            Parent::Node(p) => {
                let pn = self.node_mut(p);
                pn.children.push(n);
                pn.children_in[loc.tier.index()] += 1;
            }
            Parent::Root(r) => {
                if let Some(root) = self.roots[r as usize].as_mut() {
                    root.children.push(n);
                }
            }
        }
        Insert::New(n)
    }

    /// Records that node `n` moved to `loc`, keeping the parent's per-tier child counts.
    pub(crate) fn relocate(&mut self, n: u32, loc: BlockLoc) {
        let old = std::mem::replace(&mut self.node_mut(n).loc, loc);
        if let Parent::Node(p) = self.node(n).parent {
            let pn = self.node_mut(p);
            pn.children_in[old.tier.index()] -= 1;
            pn.children_in[loc.tier.index()] += 1;
        }
    }

    /// Removes a childless node; its slot is reused later. Roots left without children go too.
    pub(crate) fn remove(&mut self, n: u32) {
        debug_assert!(self.childless(n));
        let (parent, token_hash, indexed, tier) = {
            let node = self.node(n);
            (node.parent, node.token_hash, node.indexed, node.loc.tier)
        };
        if indexed {
            self.index.remove(&(parent.code(), token_hash));
        }
        match parent {
            Parent::Node(p) => {
                let pn = self.node_mut(p);
                pn.children.remove(n);
                pn.children_in[tier.index()] -= 1;
            }
            Parent::Root(r) => {
                let empty = match self.roots[r as usize].as_mut() {
                    Some(root) => {
                        root.children.remove(n);
                        root.children.is_empty()
                    }
                    None => false,
                };
                if empty && let Some(root) = self.roots[r as usize].take() {
                    self.root_index.remove(&root.key);
                    self.free_roots.push(r);
                }
            }
        }
        let node = self.node_mut(n);
        node.alive = false;
        node.indexed = false;
        node.generation = node.generation.wrapping_add(1);
        node.children_in = [0, 0];
        self.free_nodes.push(n);
    }

    /// Nodes currently alive (for audits).
    pub(crate) fn live_nodes(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nodes.len() as u32).filter(|&n| self.node(n).alive)
    }
}
