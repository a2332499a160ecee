//! The lines of a `/proc/PID/maps` text, split once for every reader.
//! No reader holds a process's whole text: [`super::mappings`] reads it a
//! line at a time (or asks the kernel a mapping at a time) and hands each
//! line here; a whole text is parsed only by tests.
//!
//! A line is `START-END PERMS OFFSET MAJOR:MINOR INODE [PATH]`, numbers in
//! hex but the inode (decimal), fields separated by single spaces, the path
//! padded on its left and taken whole (it may hold spaces; the kernel
//! writes a newline in it as `\012`). Invariant: a line whose first five
//! fields do not parse is skipped, never guessed at (the text is the
//! kernel's, but a target names its own files).

/// One parsed line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapsLine<'a> {
    /// First address of the mapping.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// `rwxp` style permissions, as shown.
    pub perms: &'a str,
    /// File offset mapped at `start`.
    pub offset: u64,
    /// The device of the mapped file (major, minor).
    pub dev: (u32, u32),
    /// The mapped file's inode, 0 for an anonymous mapping.
    pub inode: u64,
    /// The path or pseudo-name (`[stack]`, `[heap]`), empty for an
    /// anonymous mapping; as shown (see
    /// [`crate::symbolization::maps::unescape_path`]).
    pub path: &'a str,
}

impl<'a> MapsLine<'a> {
    /// Parses one line, `None` if it is not a well-formed maps line.
    pub fn parse(line: &'a str) -> Option<Self> {
        let mut f = line.splitn(6, ' ');
        let (range, perms, offset, dev, inode) =
            (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
        let (s, e) = range.split_once('-')?;
        let (major, minor) = dev.split_once(':')?;
        Some(MapsLine {
            start: u64::from_str_radix(s, 16).ok()?,
            end: u64::from_str_radix(e, 16).ok()?,
            perms,
            offset: u64::from_str_radix(offset, 16).ok()?,
            dev: (
                u32::from_str_radix(major, 16).ok()?,
                u32::from_str_radix(minor, 16).ok()?,
            ),
            inode: inode.parse().ok()?,
            path: f.next().unwrap_or("").trim_start(),
        })
    }
}

/// Every well-formed line of a maps text.
pub fn maps_lines(text: &str) -> impl Iterator<Item = MapsLine<'_>> {
    text.lines().filter_map(MapsLine::parse)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_whole_with_paths_holding_spaces_and_bad_lines_skipped() {
        let text = "\
55d0c0a00000-55d0c0a21000 r-xp 00002000 fd:01 1234   /usr/bin/prog name\n\
7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0                          [stack]\n\
7f00-7e00 r--p zz 00:00 0 /bad\n\
not a line\n\
7f0000000000-7f0000001000 r--s 00000010 00:2d 42 /mnt/fuse/lib\\012x.so\n";
        let lines: Vec<_> = maps_lines(text).collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(
            lines[0],
            MapsLine {
                start: 0x55d0c0a00000,
                end: 0x55d0c0a21000,
                perms: "r-xp",
                offset: 0x2000,
                dev: (0xfd, 1),
                inode: 1234,
                path: "/usr/bin/prog name",
            }
        );
        assert_eq!((lines[1].inode, lines[1].path), (0, "[stack]"));
        assert_eq!(lines[2].dev, (0, 0x2d));
        assert_eq!(lines[2].path, "/mnt/fuse/lib\\012x.so");
    }
}
