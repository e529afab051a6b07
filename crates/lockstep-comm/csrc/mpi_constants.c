/* MPI constants that rsmpi 0.8 does not export. MPI_IN_PLACE is a macro whose value differs
 * between implementations (Open MPI: (void *) 1, MPICH and derivatives: (void *) -1), so it is
 * read from the mpi.h of the library lockstep links against. */
#include <mpi.h>

void *const lockstep_mpi_in_place = MPI_IN_PLACE;
