// SPDX-License-Identifier: Apache-2.0

// Package nodeagent is the node agent's side of ZDS: Server keeps every
// ztunnel connected to the socket told of the pods of the zds table
// (Workload rows: the pod, its uid and workload_info, the path of its
// network namespace), and writes back into each row what the newest
// ztunnel did with it. The zds-connections table lists the connections.
// The in-pod mode (package reconcilers/inpod) owns the tables, writes
// the rows' desired part and runs the server; this package has no cell
// of its own.
package nodeagent
