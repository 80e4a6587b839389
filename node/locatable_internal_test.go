package node

import (
	"errors"
	"testing"

	"github.com/kvactors/kvactors/messages"
)

// A spec with CUDA memory naming no node is refused on a cluster, by any
// node alike (it reads the spec, not the node's backend: a mixed cluster
// answers it the same everywhere); a named one, and an shm spec, pass.
func TestLocatableRefusesAnUnnamedCUDASpec(t *testing.T) {
	cuda := []messages.Segment{{CUDAIPC: "00"}}
	shm := []messages.Segment{{Shm: "e-kv"}}
	for _, tc := range []struct {
		what    string
		segs    []messages.Segment
		named   string
		refused bool
	}{
		{"cuda, unnamed", cuda, "", true},
		{"cuda and shm, unnamed", append(append([]messages.Segment{}, shm...), cuda...), "", true},
		{"cuda, named", cuda, "gpu-1", false},
		{"shm, unnamed", shm, "", false},
		{"shm, named", shm, "gpu-1", false},
	} {
		for _, backend := range []string{"shm", "cuda"} {
			n := &Node{cfg: Config{Backend: backend}}
			err := n.locatable(messages.EngineSpec{Node: tc.named, Segments: tc.segs})
			if got := err != nil; got != tc.refused {
				t.Errorf("%s on a %s node: refused %v, want %v (%v)", tc.what, backend, got, tc.refused, err)
			}
			if err != nil && !errors.Is(err, ErrRegister) {
				t.Errorf("%s: %v is not ErrRegister (answered as bad_spec)", tc.what, err)
			}
		}
	}
}
