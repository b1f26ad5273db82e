//! Reading a worker's mount table: which mounts the scan searches.

/// File systems that hold no session data: kernel interfaces and device nodes. Every other
/// writable mount is scanned.
const PSEUDO_FILESYSTEMS: &[&str] = &[
    "proc",
    "sysfs",
    "devtmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "mqueue",
    "securityfs",
    "debugfs",
    "tracefs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "hugetlbfs",
    "binfmt_misc",
    "autofs",
    "rpc_pipefs",
    "nsfs",
    "efivarfs",
    "selinuxfs",
    "nfsd",
];

/// Decodes the octal escapes (`\040` for a space, ...) of a path in `/proc/self/mounts`.
fn unescape_mount_path(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits.iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The writable, non-pseudo mount points in a `/proc/self/mounts` text, each once, in order.
pub(crate) fn writable_mounts(mounts: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, point, fstype, flags, ..] = fields[..] else {
            continue;
        };
        let writable = flags.split(',').any(|flag| flag == "rw");
        if !writable || PSEUDO_FILESYSTEMS.contains(&fstype) {
            continue;
        }
        let point = unescape_mount_path(point);
        if point.starts_with('/') && !found.contains(&point) {
            found.push(point);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_keep_writable_real_filesystems_once() {
        let table = "\
proc /proc proc rw,relatime 0 0
sysfs /sys sysfs ro,nosuid 0 0
tmpfs /dev tmpfs rw,nosuid 0 0
devpts /dev/pts devpts rw 0 0
/dev/vda / ext4 ro,relatime 0 0
/dev/vdb /workspace ext4 rw,relatime 0 0
/dev/vdc /home/agent\\040x ext4 rw 0 0
tmpfs /tmp tmpfs rw 0 0
tmpfs /tmp tmpfs rw 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw 0 0
overlay /skills overlay ro 0 0
garbage line
";
        assert_eq!(
            writable_mounts(table),
            vec!["/dev", "/workspace", "/home/agent x", "/tmp"]
        );
    }

    #[test]
    fn mount_paths_decode_octal_escapes() {
        assert_eq!(unescape_mount_path(r"/a\040b\011c\134d"), "/a b\tc\\d");
        assert_eq!(unescape_mount_path(r"/trailing\04"), r"/trailing\04");
        assert_eq!(unescape_mount_path(r"/x\999"), r"/x\999");
    }
}
