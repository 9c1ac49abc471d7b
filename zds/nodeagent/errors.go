// SPDX-License-Identifier: Apache-2.0

package nodeagent

import "errors"

// ErrNotSocket: something other than a socket is at --zds-socket's path;
// the agent does not replace it.
var ErrNotSocket = errors.New("not a socket")
