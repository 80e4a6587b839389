package cuda

import "fmt"

// Name is the backend's name, as in `--backend cuda` and Backend.Name.
const Name = "cuda"

// maxStreams bounds Config.Streams: more streams than copy engines buy nothing.
const maxStreams = 64

// Config configures the CUDA backend. The zero value means the defaults.
type Config struct {
	// Device is the CUDA device ordinal (as in cuDeviceGet) the engines'
	// segments live on; segments naming another device are refused.
	// Must be >= 0.
	Device int `json:"device"`
	// Streams is how many CUDA streams copies are spread over, one Copy call
	// per stream, round robin. Zero means the default, 2: a store and a load
	// then run at once on the GPU's separate copy engines. 1..64.
	Streams int `json:"streams"`
}

// DefaultConfig returns device 0 with two streams.
func DefaultConfig() Config {
	return Config{Device: 0, Streams: 2}
}

// withDefaults fills zero fields from DefaultConfig.
func (c Config) withDefaults() Config {
	if c.Streams == 0 {
		c.Streams = DefaultConfig().Streams
	}
	return c
}

// Validate reports the first field out of its limits. Zero fields count as
// their defaults.
func (c Config) Validate() error {
	c = c.withDefaults()
	if c.Device < 0 {
		return fmt.Errorf("cuda: device %d: must be >= 0", c.Device)
	}
	if c.Streams < 1 || c.Streams > maxStreams {
		return fmt.Errorf("cuda: streams %d: must be in 1..%d", c.Streams, maxStreams)
	}
	return nil
}
