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
// PackStream re-encodes a layer that arrives as a stream (a sandbox CLI's
// tar), in full or as a delta against a base layer's file index;
// MergeLayers folds a delta onto its base. Save and Load move layers into
// and out of a store (the store subpackage) with their manifests, so that
// an interrupted save never leaves a layer a load would trust. The package
// knows nothing about sandboxes.
package snapshot
