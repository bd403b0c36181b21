package nlsend

// TableThere is tableThere, for the tests of package nlsend_test, which
// encode real batches with package nft (an import cycle from here).
var TableThere = tableThere
