package appliance

import (
	"testing"

	"github.com/sandgate/sandgate/appliance/localbox"
)

// TestTrustPathsAgree: the files the agent points commands at are the
// ones `sandgate sandbox` writes the CA into.
func TestTrustPathsAgree(t *testing.T) {
	if SandboxTrustBundle != localbox.TrustBundle || SandboxTrustCA != localbox.TrustedCAFile {
		t.Errorf("the launcher names %s and %s, localbox writes %s and %s", SandboxTrustBundle, SandboxTrustCA, localbox.TrustBundle, localbox.TrustedCAFile)
	}
}
