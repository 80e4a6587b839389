//go:build !cuda

package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
)

func TestNewNotBuilt(t *testing.T) {
	b, err := New(DefaultConfig())
	require.ErrorIs(t, err, backend.ErrNotBuilt)
	require.ErrorContains(t, err, "-tags cuda")
	require.Nil(t, b)
}
