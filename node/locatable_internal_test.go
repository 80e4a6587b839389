package node

import (
	"errors"
	"testing"

	"github.com/kvactors/kvactors/messages"
)

// A cuda node on a cluster refuses a spec naming no node (it cannot tell
// the spec's host); a named one, and any spec on an shm node, pass.
func TestLocatableRefusesAnUnnamedSpecOnlyOnCUDA(t *testing.T) {
	for _, tc := range []struct {
		backend, named string
		refused        bool
	}{
		{"cuda", "", true},
		{"cuda", "gpu-1", false},
		{"shm", "", false},
		{"shm", "gpu-1", false},
	} {
		n := &Node{cfg: Config{Backend: tc.backend}}
		err := n.locatable(messages.EngineSpec{Node: tc.named})
		if got := err != nil; got != tc.refused {
			t.Errorf("backend %s, node %q: refused %v, want %v (%v)", tc.backend, tc.named, got, tc.refused, err)
		}
		if err != nil && !errors.Is(err, ErrRegister) {
			t.Errorf("backend %s: %v is not ErrRegister (answered as bad_spec)", tc.backend, err)
		}
	}
}
