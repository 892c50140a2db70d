"""Layer tars: the rules every reader and writer keeps, the reader, and (de)compression."""
