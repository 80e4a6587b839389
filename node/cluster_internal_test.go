package node

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
)

type countingDevice struct {
	backend.Attachment
	copies int
}

func (d *countingDevice) Copy(backend.Direction, backend.Arena, []backend.Range) error {
	d.copies++
	return nil
}

// A copy for an engine whose claim may have lapsed never reaches the
// device; while the claim holds, copies pass through.
func TestOwnedDeviceRefusesCopiesOnceTheClaimMayHaveLapsed(t *testing.T) {
	inner := &countingDevice{}
	serving := true
	d := &ownedDev{Attachment: inner, engine: "e1", serving: func() bool { return serving }}
	require.NoError(t, d.Copy(backend.HostToDevice, nil, nil))
	require.Equal(t, 1, inner.copies)
	serving = false
	err := d.Copy(backend.DeviceToHost, nil, nil)
	require.True(t, errors.Is(err, errNotOwner), "%v", err)
	require.Contains(t, err.Error(), "e1")
	require.Equal(t, 1, inner.copies, "the device was not touched")
	require.Equal(t, backend.Attachment(inner), (&Node{}).ownedDevice("e1", inner), "no wrapper without a cluster")
}
