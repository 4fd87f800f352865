// Package snapshot saves and restores filesystem layers: the writable upper
// directory of a sandbox, or a template, as a compressed tar stream with a
// manifest.
//
// Pack turns a directory (normally an overlayfs upper made with
// redirect_dir=off,metacopy=off) into a PAX tar stream, translating overlay
// whiteouts (0/0 character devices, the trusted.overlay.opaque xattr) into
// OCI whiteouts (.wh.<name>, .wh..wh..opq). It compresses the stream with
// zstd or gzip and hashes both the tar and the compressed bytes while they
// stream, so a Manifest is ready the moment the last byte is written.
//
// Unpack applies such a stream to a directory, either as an overlay upper
// (OCI whiteouts back to overlay whiteouts) or as a plain tree (whiteouts
// delete what they name). Extraction never follows a symlink it did not
// resolve itself, refuses hostile entries by name, caps bytes and entries,
// and stages everything in a fresh directory so a refused archive leaves
// nothing where the caller looks.
//
// PackDelta and MergeLayers produce and fold a layer relative to a base
// layer's file index. Stores for the compressed objects live in the store
// subpackage. The package knows nothing about sandboxes.
package snapshot
