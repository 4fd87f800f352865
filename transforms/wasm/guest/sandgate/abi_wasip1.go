//go:build wasip1

package sandgate

import "unsafe"

// The imports of sandgate's host module "sandgate".

//go:wasmimport sandgate sandbox_id
func hostSandboxID(buf unsafe.Pointer, limit uint32) uint32

//go:wasmimport sandgate audit_note
func hostAuditNote(note string)

//go:wasmimport sandgate refuse
func hostRefuse(status uint32, reason string)
