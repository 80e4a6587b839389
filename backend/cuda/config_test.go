package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestConfig(t *testing.T) {
	require.Equal(t, Config{Device: 0, Streams: 2}, DefaultConfig())
	require.NoError(t, DefaultConfig().Validate())
	require.NoError(t, Config{}.Validate(), "zero value means the defaults")
	require.Equal(t, DefaultConfig(), Config{}.withDefaults())
	require.NoError(t, Config{Device: 3, Streams: maxStreams}.Validate())

	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"negative device", Config{Device: -1}, "device -1"},
		{"negative streams", Config{Streams: -1}, "streams -1"},
		{"too many streams", Config{Streams: maxStreams + 1}, "streams 65"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorContains(t, tc.cfg.Validate(), tc.want)
		})
	}
}
