package mesh

import (
	"os"

	"golang.org/x/sys/unix"
)

// dupFile returns an independent descriptor for f's open file, close-on-exec.
func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}
