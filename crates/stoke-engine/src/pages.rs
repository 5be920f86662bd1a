//! The pages of the KV pool: which are free, how many sequences hold each, and which hold the
//! keys and values of a known prompt prefix.
//!
//! Page [`stoke::SPARE_PAGE`] is the decoder's and never handed out. A page holding a full
//! page of prompt tokens whose keys and values have been queued is registered under the hash of
//! its tokens and of every token before it (a chain: page `i`'s key is `H(key of page i - 1,
//! tokens of page i)`); a later prompt with the same tokens up to that page shares it instead of
//! computing it. The tokens are kept beside the hash and compared on every hit, so a hash
//! collision never shares the wrong page. A registered page no sequence holds any more stays
//! cached until a page is needed and none is free: then the least recently released one is
//! taken back.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The key of a full page of prompt tokens: its tokens and the key of the page before it.
pub fn page_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The keys of the full pages of `tokens` (pages of `page` tokens), in order.
pub fn prefix_keys(tokens: &[u32], page: usize) -> Vec<u64> {
    let mut parent = 0;
    tokens
        .chunks_exact(page)
        .map(|t| {
            parent = page_key(parent, t);
            parent
        })
        .collect()
}

/// What a registered page holds.
#[derive(Clone, Debug)]
struct Cached {
    key: u64,
    parent: u64,
    tokens: Vec<u32>,
}

/// The pool's bookkeeping (no device memory: the decoder owns that).
#[derive(Debug)]
pub struct PagePool {
    free: Vec<u32>,
    refs: Vec<u32>,
    cached: Vec<Option<Cached>>,
    by_key: HashMap<u64, u32>,
    /// Registered pages no sequence holds, by release time (the oldest taken back first).
    idle: BTreeMap<u64, u32>,
    idle_at: Vec<u64>,
    clock: u64,
    /// Pages shared instead of computed, and pages looked up, since the start.
    pub hits: u64,
    pub lookups: u64,
}

impl PagePool {
    /// A pool of `pages` pages; page 0 (the decoder's spare page) is never handed out.
    pub fn new(pages: usize) -> Self {
        Self {
            free: (1..pages as u32).rev().collect(),
            refs: vec![0; pages],
            cached: vec![None; pages],
            by_key: HashMap::new(),
            idle: BTreeMap::new(),
            idle_at: vec![0; pages],
            clock: 0,
            hits: 0,
            lookups: 0,
        }
    }

    /// Pages a sequence may hold (every page but the spare one).
    pub fn usable(&self) -> usize {
        self.refs.len() - 1
    }

    /// Pages that can be handed out now (free, or cached and idle).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Pages some sequence holds.
    pub fn used(&self) -> usize {
        self.usable() - self.available()
    }

    /// Registered pages (held or idle).
    pub fn cached(&self) -> usize {
        self.by_key.len()
    }

    /// A page for one sequence: a free one, else the longest idle cached one (forgotten).
    pub fn alloc(&mut self) -> Option<u32> {
        let page = match self.free.pop() {
            Some(p) => p,
            None => {
                let (_, p) = self.idle.pop_first()?;
                let c = self.cached[p as usize]
                    .take()
                    .expect("idle pages are cached");
                self.by_key.remove(&c.key);
                p
            }
        };
        self.refs[page as usize] = 1;
        Some(page)
    }

    /// `n` pages, or none (and nothing taken) when fewer are available.
    pub fn alloc_n(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.available() < n {
            return None;
        }
        Some((0..n).map(|_| self.alloc().expect("counted")).collect())
    }

    /// The cached page of the full page `tokens` after the prefix whose key is `parent`, held
    /// once more; `None` where none is cached.
    pub fn share(&mut self, parent: u64, tokens: &[u32]) -> Option<u32> {
        self.lookups += 1;
        let key = page_key(parent, tokens);
        let &page = self.by_key.get(&key)?;
        let c = self.cached[page as usize]
            .as_ref()
            .expect("keyed pages are cached");
        if c.parent != parent || c.tokens != tokens {
            return None;
        }
        if self.refs[page as usize] == 0 {
            self.idle.remove(&self.idle_at[page as usize]);
        }
        self.refs[page as usize] += 1;
        self.hits += 1;
        Some(page)
    }

    /// Registers `page` (held) as holding the full page `tokens` after the prefix whose key is
    /// `parent`; returns its key. A page already registered, or a key another page holds, is
    /// left as it is.
    pub fn register(&mut self, page: u32, parent: u64, tokens: &[u32]) -> u64 {
        let key = page_key(parent, tokens);
        if self.cached[page as usize].is_none() && !self.by_key.contains_key(&key) {
            self.by_key.insert(key, page);
            self.cached[page as usize] = Some(Cached {
                key,
                parent,
                tokens: tokens.to_vec(),
            });
        }
        key
    }

    /// Releases one hold of `page`: with no holder left it becomes free, or idle if cached.
    pub fn release(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        assert!(*r > 0, "page {page} released more often than held");
        *r -= 1;
        if *r == 0 {
            if self.cached[page as usize].is_some() {
                self.clock += 1;
                self.idle_at[page as usize] = self.clock;
                self.idle.insert(self.clock, page);
            } else {
                self.free.push(page);
            }
        }
    }

    /// Holders of `page`.
    pub fn holders(&self, page: u32) -> u32 {
        self.refs[page as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_handed_out_shared_and_taken_back() {
        let mut p = PagePool::new(5);
        assert_eq!((p.usable(), p.available()), (4, 4));
        let a = p.alloc_n(3).unwrap();
        assert!(!a.contains(&0), "the spare page is never handed out");
        assert!(p.alloc_n(2).is_none(), "all or nothing");
        assert_eq!(p.available(), 1);
        // Register the first page of a prompt; share it; release both holders: idle, cached.
        let toks = [1, 2, 3, 4];
        let k0 = p.register(a[0], 0, &toks);
        assert_eq!(k0, prefix_keys(&toks, 4)[0]);
        assert_eq!(p.share(0, &toks), Some(a[0]));
        assert_eq!(p.holders(a[0]), 2);
        assert_eq!(p.share(0, &[1, 2, 3, 5]), None);
        assert_eq!(p.share(7, &toks), None, "another prefix before it");
        p.release(a[0]);
        p.release(a[0]);
        assert_eq!((p.available(), p.cached()), (2, 1));
        // An idle cached page is shared again without computing.
        assert_eq!(p.share(0, &toks), Some(a[0]));
        p.release(a[0]);
        // With nothing free, the idle page is taken back and forgotten.
        let b = p.alloc().unwrap();
        assert_ne!(b, a[0]);
        let c = p.alloc().unwrap();
        assert_eq!(c, a[0]);
        assert_eq!(p.cached(), 0);
        assert_eq!(p.share(0, &toks), None);
        assert!(p.alloc().is_none());
        p.release(a[1]);
        assert_eq!(p.alloc(), Some(a[1]));
        assert_eq!((p.hits, p.lookups), (2, 5));
    }

    #[test]
    fn prefix_keys_chain_the_pages() {
        let t: Vec<u32> = (0..10).collect();
        let k = prefix_keys(&t, 4);
        assert_eq!(k.len(), 2);
        assert_eq!(k[1], page_key(k[0], &t[4..8]));
        let mut u = t.clone();
        u[0] = 99;
        // The second page's tokens agree, its key does not: it follows another first page.
        assert_ne!(prefix_keys(&u, 4)[1], k[1]);
    }
}
