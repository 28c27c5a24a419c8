"""What goes where, decided before any weight is loaded: the devices and their memory, speed and links
(`devices`), what a block costs in bytes and seconds (`cost`, from the measured `calibration.json`, each
family's and each compute mode's own), the
split over stages with its forecast and verdict (`plan`), the text encoder's split while captions are
cached (`text_encoder_split`), and a plan as text (`forecast`)."""
