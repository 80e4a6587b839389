package backend_test

import (
	"testing"

	"github.com/kvactors/kvactors/backend"
)

// TestDirectionLabels: the direction labels are vLLM's transfer_type values
// (dashboards written for vLLM's offloading metrics read them), and an
// unknown direction is not mistaken for a load.
func TestDirectionLabels(t *testing.T) {
	for d, want := range map[backend.Direction]string{
		backend.DeviceToHost: "GPU_to_CPU",
		backend.HostToDevice: "CPU_to_GPU",
		backend.Direction(7): "GPU_to_CPU",
	} {
		if got := d.String(); got != want {
			t.Errorf("Direction(%d).String() = %q, want %q", d, got, want)
		}
	}
}
