package localbox

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// The default image (Config.Rootfs empty) is built from an allowlist,
// never from the host's whole root: a sandbox sees the host's programs and
// libraries and nothing else of it.
//
//   - hostDirs: each of these host directories that is a real directory is
//     the lower layer of an overlay of its own at the same place (so a
//     sandbox can install into /usr, into its own layer); each that is a
//     symbolic link (/bin -> usr/bin on a merged-/usr system) is the same
//     link in the image; a missing one is missing.
//   - /etc is made for the sandbox (buildBase): its users and groups, host
//     names, name service switch and resolver of its own, and copies of the
//     host files programs need (etcCopy), never the rest of the host's
//     /etc (no shadow, SSH keys, private TLS keys, service configuration).
//   - /root, /home, /var, /srv, /opt, /mnt, /run, /media are empty and the
//     sandbox's own.
//
// The base layer (buildBase) lives on the scaffold's tmpfs, so it is made
// afresh each time a sandbox starts and is never in its layer; what a
// sandbox changes of it (adding a user, say) is copied up into its upper
// like any other file.
var hostDirs = []string{"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"}

// etcCopy are the host's /etc entries the default image copies (files and
// symbolic links as they are, directories with their contents, regular
// files up to etcCopyMax each): what dynamic linking, TLS, locales, time
// zones, Debian's alternatives (/usr/bin/awk -> /etc/alternatives/awk) and
// language runtimes read. Nothing that may hold a secret: ssl/private,
// pki's private keys, shadow files, SSH keys, and the configuration files
// that often carry tokens (gitconfig, npmrc, pip.conf, environment) are
// not named, and a name here never reaches into them (ssl and pki are
// copied by subdirectory).
var etcCopy = []string{
	"alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "os-release", "debian_version",
	"lsb-release", "redhat-release", "alpine-release", "system-release",
	"ssl/certs", "ssl/openssl.cnf", "ssl/cert.pem", "ca-certificates.conf", "ca-certificates",
	"pki/tls/certs", "pki/tls/openssl.cnf", "pki/ca-trust/extracted", "pki/ca-trust/source/anchors",
	"crypto-policies/back-ends", "crypto-policies/config",
	"localtime", "timezone", "locale.alias", "locale.conf", "locale.gen", "default/locale",
	"protocols", "services", "networks", "host.conf", "gai.conf", "ethertypes", "rpc",
	"mime.types", "magic", "magic.mime", "shells", "login.defs", "adduser.conf", "deluser.conf",
	"profile", "profile.d", "bash.bashrc", "inputrc", "skel", "terminfo",
	"java-8-openjdk", "java-11-openjdk", "java-17-openjdk", "java-21-openjdk", "java-25-openjdk",
	"python3", "perl", "fonts", "manpath.config", "mke2fs.conf", "xattr.conf",
}

// etcCopyMax bounds each file copied into the base layer (it lives in
// memory, once per running sandbox).
const etcCopyMax = 4 << 20

// emptyDirs are the directories of the default image that are the
// sandbox's own and start empty (mode, and whether /var/tmp-like).
var emptyDirs = []struct {
	name string
	mode os.FileMode
}{
	{"root", 0o700}, {"home", 0o755}, {"srv", 0o755}, {"opt", 0o755}, {"mnt", 0o755},
	{"media", 0o755}, {"run", 0o755}, {"run/lock", 0o1777}, {"var", 0o755}, {"var/tmp", 0o1777},
	{"var/lib", 0o755}, {"var/cache", 0o755}, {"var/log", 0o755}, {"var/spool", 0o755},
	{"var/mail", 0o755}, {"var/opt", 0o755}, {"var/local", 0o755}, {"usr", 0o755},
	{"proc", 0o555}, {"sys", 0o555}, {"dev", 0o755}, {"tmp", 0o1777},
}

// The users and groups of the default image. Commands run as root; "agent"
// owns the default home of protocol 1 (/home/agent), for programs that
// switch to an unprivileged user.
const (
	basePasswd = `root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
bin:x:2:2:bin:/bin:/usr/sbin/nologin
sys:x:3:3:sys:/dev:/usr/sbin/nologin
agent:x:1000:1000:agent:/home/agent:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
`
	baseGroup = `root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
disk:x:6:
wheel:x:10:
staff:x:50:
users:x:100:
agent:x:1000:
nogroup:x:65534:
`
	baseNsswitch = `passwd:         files
group:          files
shadow:         files
hosts:          files dns
networks:       files
protocols:      files
services:       files
ethers:         files
rpc:            files
`
	// A sandbox has no network and no name server: loopback answers at
	// once (nothing listens on port 53), so a lookup fails immediately
	// instead of timing out.
	baseResolv = "nameserver 127.0.0.1\noptions attempts:1 timeout:1\n"
)

// buildBase makes the default image's base layer in base (an empty
// directory on the scaffold's tmpfs): the sandbox's own /etc, its empty
// directories, the mount points of hostDirs and the links among them.
// Everything is owned by the sandbox's root, uid and gid on the host.
func buildBase(base, id string, uid, gid int, trustCA []byte) error {
	chown := func(p string) error { return os.Lchown(p, uid, gid) }
	mkdir := func(rel string, mode os.FileMode) error {
		p := filepath.Join(base, rel)
		if err := os.Mkdir(p, mode); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		if err := os.Chmod(p, mode); err != nil {
			return err
		}
		return chown(p)
	}
	for _, d := range emptyDirs {
		if err := mkdir(d.name, d.mode); err != nil {
			return err
		}
	}
	for _, l := range [][2]string{{"var/run", "../run"}, {"var/lock", "../run/lock"}} {
		if err := os.Symlink(l[1], filepath.Join(base, l[0])); err != nil {
			return err
		}
		if err := chown(filepath.Join(base, l[0])); err != nil {
			return err
		}
	}
	for _, d := range hostDirs {
		fi, err := os.Lstat("/" + d)
		switch {
		case err != nil:
			continue
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink("/" + d)
			if err != nil {
				return err
			}
			if err := os.Symlink(target, filepath.Join(base, d)); err != nil && !errors.Is(err, fs.ErrExist) {
				return err
			}
			if err := chown(filepath.Join(base, d)); err != nil {
				return err
			}
		case fi.IsDir():
			if err := mkdir(d, fi.Mode().Perm()); err != nil {
				return err
			}
		}
	}
	if err := mkdir("etc", 0o755); err != nil {
		return err
	}
	etc := filepath.Join(base, "etc")
	for _, rel := range etcCopy {
		if err := copyEtc(filepath.Join("/etc", rel), filepath.Join(etc, rel), etc, uid, gid); err != nil {
			return fmt.Errorf("/etc/%s: %w", rel, err)
		}
	}
	hosts := "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t" + id + "\n"
	for name, content := range map[string]string{
		"passwd": basePasswd, "group": baseGroup, "nsswitch.conf": baseNsswitch,
		"resolv.conf": baseResolv, "hosts": hosts, "hostname": id + "\n",
	} {
		p := filepath.Join(etc, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return err
		}
		if err := chown(p); err != nil {
			return err
		}
	}
	if err := os.Symlink("../proc/self/mounts", filepath.Join(etc, "mtab")); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if err := chown(filepath.Join(etc, "mtab")); err != nil {
		return err
	}
	return addTrust(etc, trustCA, uid, gid)
}

// TrustedCAFile and TrustBundle are where the default image has the CA
// certificates of Config.TrustCA: alone, and in the system bundle (which
// always exists when TrustCA is given).
const (
	TrustedCAFile = "/etc/ssl/certs/sandgate-ca.pem"
	TrustBundle   = "/etc/ssl/certs/ca-certificates.crt"
)

// systemBundles are the CA bundles of the distributions, under /etc, that
// TLS libraries read by default.
var systemBundles = []string{"ssl/certs/ca-certificates.crt", "ssl/cert.pem", "pki/tls/certs/ca-bundle.crt", "pki/ca-trust/extracted/pem/tls-ca-bundle.pem"}

// addTrust adds the certificates of ca to the image's /etc (etc): to every
// system bundle it copied (a link to one is left to it), as
// TrustedCAFile, and as TrustBundle when the host has none there. Every
// file is reached inside etc only (os.Root): a link copied from the host
// that points out of it is never written through.
func addTrust(etc string, ca []byte, uid, gid int) error {
	if len(ca) == 0 {
		return nil
	}
	root, err := os.OpenRoot(etc)
	if err != nil {
		return err
	}
	defer root.Close()
	pemCA := append(bytes.TrimRight(ca, "\n"), '\n')
	write := func(rel string, data []byte, flag int) error {
		if err := root.MkdirAll(filepath.Dir(rel), 0o755); err != nil {
			return err
		}
		f, err := root.OpenFile(rel, os.O_WRONLY|os.O_CREATE|flag, 0o644)
		if err != nil {
			return err
		}
		_, err = f.Write(data)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		return root.Lchown(rel, uid, gid)
	}
	var first []byte
	for _, rel := range systemBundles {
		fi, err := root.Lstat(rel)
		if err != nil || !fi.Mode().IsRegular() {
			continue
		}
		old, err := root.ReadFile(rel)
		if err != nil {
			return err
		}
		sep := []byte{}
		if len(old) > 0 && old[len(old)-1] != '\n' {
			sep = []byte{'\n'}
		}
		if err := write(rel, append(sep, pemCA...), os.O_APPEND); err != nil {
			return err
		}
		if first == nil {
			first = append(append(old, sep...), pemCA...)
		}
	}
	bundle := strings.TrimPrefix(TrustBundle, "/etc/")
	if _, err := root.Lstat(bundle); errors.Is(err, fs.ErrNotExist) {
		if first == nil {
			first = pemCA
		}
		if err := write(bundle, first, os.O_TRUNC); err != nil {
			return err
		}
	}
	return write(strings.TrimPrefix(TrustedCAFile, "/etc/"), pemCA, os.O_TRUNC)
}

// copyEtc copies the host's src (a file, a symbolic link as it is, or a
// directory and what it holds) to dst, creating dst's parents up to top,
// owned by uid and gid. A missing src is skipped, as is anything that is
// neither a regular file, a directory nor a link, and any file larger than
// etcCopyMax.
func copyEtc(src, dst, top string, uid, gid int) error {
	fi, err := os.Lstat(src)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := mkdirOwned(filepath.Dir(dst), top, uid, gid); err != nil {
		return err
	}
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(src)
		if err != nil {
			return err
		}
		if err := os.Symlink(target, dst); err != nil {
			return err
		}
	case fi.IsDir():
		if err := os.Mkdir(dst, fi.Mode().Perm()); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		ents, err := os.ReadDir(src)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if err := copyEtc(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name()), top, uid, gid); err != nil {
				return err
			}
		}
	case fi.Mode().IsRegular():
		if fi.Size() > etcCopyMax {
			return nil
		}
		if err := copyFile(src, dst, fi.Mode().Perm()); err != nil {
			return err
		}
	default:
		return nil
	}
	return os.Lchown(dst, uid, gid)
}

// mkdirOwned makes dir and any missing parent up to top (which exists),
// each new one mode 0755 and owned by uid and gid.
func mkdirOwned(dir, top string, uid, gid int) error {
	rel, err := filepath.Rel(top, dir)
	if err != nil || !within(dir, top) {
		return fmt.Errorf("%s is not inside %s", dir, top)
	}
	cur := top
	for _, part := range strings.Split(rel, "/") {
		if part == "." {
			continue
		}
		cur = filepath.Join(cur, part)
		if err := os.Mkdir(cur, 0o755); err != nil {
			if errors.Is(err, fs.ErrExist) {
				continue
			}
			return err
		}
		if err := os.Lchown(cur, uid, gid); err != nil {
			return err
		}
	}
	return nil
}

// copyFile copies the regular file src to a new file dst, not following a
// symbolic link at src.
func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, io.LimitReader(in, etcCopyMax))
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}

// imageDirs returns the host directories the default image shows and the
// place each is seen at: hostDirs that are real directories.
func imageDirs() []string {
	var out []string
	for _, d := range hostDirs {
		if fi, err := os.Lstat("/" + d); err == nil && fi.IsDir() {
			out = append(out, d)
		}
	}
	return out
}

// isDefaultImage reports whether rootfs names the default image.
func isDefaultImage(rootfs string) bool { return strings.TrimSpace(rootfs) == "" }
