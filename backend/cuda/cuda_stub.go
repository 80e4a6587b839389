//go:build !cuda

package cuda

import (
	"fmt"

	"github.com/kvactors/kvactors/backend"
)

// New returns backend.ErrNotBuilt: this binary was built without the cuda
// tag, so it has no CUDA backend. It lets `--backend cuda` fail with a clear
// error instead of an unknown name.
func New(Config) (backend.Backend, error) {
	return nil, fmt.Errorf("cuda: %w (rebuild with -tags cuda and the CUDA driver)", backend.ErrNotBuilt)
}
