//! Naming an allocation site by the frames that tell it apart.
//!
//! A program that allocates through its own wrapper (redis's `zmalloc`,
//! glib's `g_malloc`, postgres's `palloc`, a C++ pool) has that wrapper as
//! the innermost frame of most of its sites: named by their innermost
//! frame, thirteen rows read `zmalloc`. A site is named instead by the
//! first frame past its *wrappers*, with its caller (`lpInsert ←
//! quicklistPushHead`), the wrapper shown apart (`via zmalloc`), as
//! pprof's drop-frames and heaptrack's caller view do.
//!
//! A leading frame is a wrapper when its function's name says it
//! allocates (it contains `alloc` or `strdup`, in any case: `malloc`,
//! `zmalloc`, `g_malloc0`, `palloc`, `MemoryContextAlloc`,
//! `PyObject_Malloc`, `ngx_palloc`, `xstrdup`) and it leads the stacks of
//! at least two sites of the snapshot (a function that allocates at one
//! site only is that site). The frames themselves are never changed;
//! only the name shown.

use std::collections::HashMap;

use crate::process::snapshot::{Site, Snapshot};
use crate::symbolization::symbolizer::Frame;

/// A site's name: the frames that tell it apart, and the wrappers it went
/// through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteName {
    /// `first ← its caller`, or the one frame there is.
    pub title: String,
    /// The wrappers passed over, innermost first (`zmalloc`), if any.
    pub via: Option<String>,
    /// How many leading frames of the site those wrappers are.
    pub wrapper_frames: usize,
}

impl std::fmt::Display for SiteName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.via {
            Some(v) => write!(f, "{} (via {v})", self.title),
            None => f.write_str(&self.title),
        }
    }
}

/// The wrappers of one snapshot (see the module's rule).
#[derive(Clone, Debug, Default)]
pub struct Wrappers {
    leading: HashMap<String, usize>,
}

/// A function's name without its parameters (`f(int)` -> `f`).
fn bare(f: &Frame) -> Option<&str> {
    let name = f.function.as_deref()?;
    Some(name.split('(').next().unwrap_or(name))
}

fn named_like_an_allocator(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let last = lower.rsplit("::").next().unwrap_or(&lower);
    last.contains("alloc") || last.contains("strdup")
}

impl Wrappers {
    /// The wrappers of `s`: allocator-named functions leading the stacks
    /// of at least two of its sites.
    pub fn of(s: &Snapshot) -> Wrappers {
        Self::of_sites(&s.sites)
    }

    /// As [`Wrappers::of`], from the sites alone.
    pub fn of_sites(sites: &[Site]) -> Wrappers {
        let mut leading: HashMap<String, usize> = HashMap::new();
        for site in sites {
            for f in &site.frames {
                match bare(f) {
                    Some(n) if named_like_an_allocator(n) => {
                        *leading.entry(n.to_string()).or_default() += 1
                    }
                    _ => break,
                }
            }
        }
        leading.retain(|_, n| *n >= 2);
        Wrappers { leading }
    }

    fn is_wrapper(&self, f: &Frame) -> bool {
        bare(f).is_some_and(|n| self.leading.contains_key(n))
    }

    /// The name of `site`.
    pub fn name(&self, site: &Site) -> SiteName {
        let skip = site
            .frames
            .iter()
            .take_while(|f| self.is_wrapper(f))
            .count();
        // A stack of wrappers only is named by its own frames.
        let skip = if skip == site.frames.len() { 0 } else { skip };
        let rest = &site.frames[skip..];
        let title = match rest {
            [] => "[no stack]".to_string(),
            [only] => only.display_name(),
            [first, caller, ..] => format!("{} ← {}", first.display_name(), caller.display_name()),
        };
        let via = (skip > 0).then(|| {
            let mut names: Vec<&str> = site.frames[..skip].iter().filter_map(bare).collect();
            // An inlined frame and its function's own frame: named once.
            names.dedup();
            names.join(" ← ")
        });
        SiteName {
            title,
            via,
            wrapper_frames: skip,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(names: &[&str]) -> Site {
        Site {
            frames: names
                .iter()
                .map(|n| Frame {
                    function: Some(n.to_string()),
                    ..Frame::default()
                })
                .collect(),
            ..Site::default()
        }
    }

    #[test]
    fn sites_are_named_past_their_allocation_wrappers() {
        let sites = vec![
            site(&[
                "ztrymalloc_usable_internal",
                "zmalloc",
                "lpInsert",
                "quicklistPushHead",
            ]),
            site(&[
                "ztrymalloc_usable_internal",
                "zmalloc",
                "sdsnewlen",
                "createObject",
            ]),
            site(&["my_alloc_once", "main"]),
            site(&["lpNew", "quicklistCreateNode"]),
        ];
        let w = Wrappers::of_sites(&sites);
        let n = w.name(&sites[0]);
        assert_eq!(n.title, "lpInsert ← quicklistPushHead");
        assert_eq!(
            n.via.as_deref(),
            Some("ztrymalloc_usable_internal ← zmalloc")
        );
        assert_eq!(w.name(&sites[1]).title, "sdsnewlen ← createObject");
        // Leading one site only: that site's own function.
        assert_eq!(w.name(&sites[2]).title, "my_alloc_once ← main");
        assert_eq!(w.name(&sites[2]).via, None);
        assert_eq!(w.name(&sites[3]).to_string(), "lpNew ← quicklistCreateNode");
        // Inlined into itself (one function's inlined and outer frames):
        // named once.
        let inlined = vec![
            site(&[
                "_PyObject_Malloc",
                "_PyObject_Malloc",
                "PyByteArray_Resize",
                "init",
            ]),
            site(&["_PyObject_Malloc", "list_resize"]),
        ];
        let w = Wrappers::of_sites(&inlined);
        assert_eq!(w.name(&inlined[0]).via.as_deref(), Some("_PyObject_Malloc"));
        assert_eq!(w.name(&inlined[0]).wrapper_frames, 2);
        // Only wrappers: named by them.
        let only = vec![site(&["g_malloc"]), site(&["g_malloc", "g_malloc0"])];
        let w = Wrappers::of_sites(&only);
        assert_eq!(w.name(&only[0]).title, "g_malloc");
    }
}
