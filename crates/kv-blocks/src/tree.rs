//! The radix tree of reusable full blocks, one node per block, keyed by the block's tokens under
//! its parent. Tokens live in one arena (`tokens_per_block` slots per node), so storing a block
//! is a copy into place and a hash-map insert.

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

#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) parent: Parent,
    pub(crate) loc: BlockLoc,
    pub(crate) hash: u64,
    token_hash: u64,
    pub(crate) children: Vec<u32>,
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
}

struct Root {
    key: RootKey,
    hash: u64,
    children: Vec<u32>,
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
    pub(crate) fn new(tokens_per_block: u32) -> Self {
        Tree {
            bs: tokens_per_block as usize,
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
            children: Vec::new(),
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

    pub(crate) fn tokens(&self, n: u32) -> &[u32] {
        let start = n as usize * self.bs;
        &self.tokens[start..start + self.bs]
    }

    /// The key of the root a node descends from, and the node's depth (0 for a first block).
    pub(crate) fn root_key_of(&self, mut n: u32) -> (&RootKey, u32) {
        let depth = self.node(n).depth;
        loop {
            match self.node(n).parent {
                Parent::Node(p) => n = p,
                Parent::Root(r) => {
                    let root = self.roots[r as usize]
                        .as_ref()
                        .expect("invariant: a live node's root is live");
                    return (&root.key, depth);
                }
            }
        }
    }

    pub(crate) fn children(&self, parent: Parent) -> &[u32] {
        match parent {
            Parent::Node(n) => &self.node(n).children,
            Parent::Root(r) => self.roots[r as usize]
                .as_ref()
                .map_or(&[], |root| &root.children),
        }
    }

    /// The child of `parent` holding exactly `tokens` (a full block).
    pub(crate) fn lookup(&self, parent: Parent, tokens: &[u32]) -> Option<u32> {
        let n = *self.index.get(&(parent.code(), hash_tokens(tokens)))?;
        (self.tokens(n) == tokens).then_some(n)
    }

    /// The parent's hash: chained hashes start from the root's.
    pub(crate) fn parent_hash(&self, parent: Parent) -> Option<u64> {
        match parent {
            Parent::Node(n) => Some(self.node(n).hash),
            Parent::Root(_) => None,
        }
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
        let token_hash = hash_tokens(tokens);
        let key = (parent.code(), token_hash);
        if let Some(&n) = self.index.get(&key) {
            return if self.tokens(n) == tokens {
                Insert::Existing(n)
            } else {
                Insert::Collision
            };
        }
        let (parent_hash, depth) = match parent {
            Parent::Node(p) => (self.node(p).hash, self.node(p).depth + 1),
            Parent::Root(r) => (
                self.roots[r as usize].as_ref().map_or(0, |root| root.hash),
                0,
            ),
        };
        let node = Node {
            parent,
            loc,
            hash: chain(parent_hash, token_hash),
            token_hash,
            children: Vec::new(),
            children_in: [0, 0],
            priority,
            prio_gen: 0,
            last_used,
            generation: 0,
            alive: true,
            depth,
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
        self.index.insert(key, n);
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
        debug_assert!(self.node(n).children.is_empty());
        let (parent, token_hash, tier) = {
            let node = self.node(n);
            (node.parent, node.token_hash, node.loc.tier)
        };
        self.index.remove(&(parent.code(), token_hash));
        match parent {
            Parent::Node(p) => {
                let pn = self.node_mut(p);
                pn.children.retain(|&c| c != n);
                pn.children_in[tier.index()] -= 1;
            }
            Parent::Root(r) => {
                let empty = match self.roots[r as usize].as_mut() {
                    Some(root) => {
                        root.children.retain(|&c| c != n);
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
        node.generation = node.generation.wrapping_add(1);
        node.children_in = [0, 0];
        self.free_nodes.push(n);
    }

    /// Nodes currently alive (for audits).
    pub(crate) fn live_nodes(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nodes.len() as u32).filter(|&n| self.node(n).alive)
    }
}
